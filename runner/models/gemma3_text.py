"""Gemma 3 text (model_type "gemma3_text"; Gemma3ForCausalLM, and the language model of
Gemma3ForConditionalGeneration, whose config nests it in `text_config` and whose checkpoints name
it `language_model.model.*`; runner/models/gemma3.py serves that architecture, vision tower and
all, around this file's model): local and global attention
layers (`sliding_window_pattern`, or `layer_types`), the local ones windowed with their own RoPE
base; per-head query/key norms; `(1 + w)` RMSNorms before and after both attention and MLP;
embeddings scaled by sqrt(hidden); GELU-gated MLP; tied output head. Soft-capping where
configured, as Gemma 2 defines it: `attn_logit_softcapping` squashes each attention score to
`tanh(s / cap) * cap` before the mask and softmax (runner/nn/attention.py's `attend`), and
`final_logit_softcapping` the logits the same way (`softcap`).
Self-contained, after mlx-lm's gemma3_text.py. GGUF files (`general.architecture = gemma3`) store
the norms as `1 + w`, which `from_gguf` undoes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import Cache, KVCache, SlidingWindowCache
from runner.nn import norm
from runner.nn.attention import Attention
from runner.nn.embedding import Embedding
from runner.nn.linear import Linear

ARCHITECTURES = ("Gemma3ForCausalLM",)  # the multimodal one is gemma3.py's
_SKIPPED = ("vision_tower", "multi_modal_projector")  # the multimodal checkpoint's other parts
GGUF_ARCHITECTURES = ("gemma3",)
GGUF_BLOCK_NAMES = {"post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
_LLAMA_CPP_PATTERN = 6  # llama.cpp's fixed local:global pattern for gemma3 GGUFs


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    head_dim: int = 256
    num_key_value_heads: int = 1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rope_local_base_freq: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 512
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    multimodal: bool = False  # a Gemma3ForConditionalGeneration checkpoint's text half

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from config.json, ignoring the keys this architecture does not use. A
        multimodal config's `text_config` omits what its defaults (as mlx-lm reads them) say."""
        text = params.get("text_config")
        if isinstance(text, dict):
            params = {"num_attention_heads": 8, "num_key_value_heads": 4, **text,
                      "vocab_size": params.get("vocab_size", 262208),
                      "model_type": params.get("model_type"), "multimodal": True}
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})

    @property
    def prefix(self) -> str:
        """Where the checkpoint keeps the decoder: `model`, or `language_model.model`."""
        return "language_model.model" if self.multimodal else "model"

    def is_sliding(self, layer: int) -> bool:
        if self.layer_types:
            return self.layer_types[layer] == "sliding_attention"
        return (layer + 1) % self.sliding_window_pattern != 0


class RMSNorm(norm.RMSNorm):
    """Gemma's RMSNorm: the gain is `1 + weight`, so the weight starts at zero."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__(dims, eps)
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        sliding = args.is_sliding(index)
        self.self_attn = Attention(
            args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim, args.rope_local_base_freq if sliding else args.rope_theta,
            None if sliding else args.rope_scaling, scale=args.query_pre_attn_scalar ** -0.5,
            window=args.sliding_window if sliding else None, qk_norm_eps=args.rms_norm_eps,
            qk_norm=RMSNorm, softcap=args.attn_logit_softcapping)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        norm = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.pre_feedforward_layernorm = RMSNorm(*norm)
        self.post_feedforward_layernorm = RMSNorm(*norm)

    def __call__(self, x: mx.array, cache: Cache | None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # the scale is a bfloat16 constant in the reference implementation
        self.embed_scale = mx.array(args.hidden_size ** 0.5, mx.bfloat16).item()

    def __call__(self, inputs: mx.array, cache: list[Cache] | None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * mx.array(self.embed_scale, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class LanguageModel(nn.Module):
    """The decoder and its head, under the names the checkpoint uses (`model`, `lm_head`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None) -> mx.array:
        h = self.model(inputs, cache)
        return self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        if args.multimodal:  # parameters under language_model.*, as the checkpoint names them
            self.language_model = LanguageModel(args)
            return
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        if "language_model" in self:
            logits = self.language_model(inputs, cache)
        else:
            h = self.model(inputs, cache)
            logits = (self.lm_head(h) if "lm_head" in self
                      else self.model.embed_tokens.as_linear(h))
        return softcap(logits, self.args.final_logit_softcapping)

    def make_cache(self) -> list[Cache]:
        """Local layers keep only their window; global layers the whole history."""
        args = self.args
        return [SlidingWindowCache(args.sliding_window) if args.is_sliding(i) else KVCache()
                for i in range(args.num_hidden_layers)]

    @property
    def layers(self) -> list[DecoderLayer]:
        decoder = self.language_model.model if "language_model" in self else self.model
        return decoder.layers


def softcap(logits: mx.array, cap: float | None) -> mx.array:
    """`final_logit_softcapping`: the logits squashed into (-cap, cap); unchanged without one."""
    return mx.tanh(logits / cap) * cap if cap else logits


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop what inference never reads: rotary caches, and a multimodal checkpoint's vision
    tower and projector."""
    return {k: v for k, v in weights.items()
            if "rotary_emb.inv_freq" not in k and not k.startswith(_SKIPPED)}


def gguf_config(config: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """The local:global pattern (an int, or one bool per layer, true for a sliding layer; 6 when
    absent, as llama.cpp assumes), and what llama.cpp fixes rather than stores: the local RoPE
    base and the attention scale (1/sqrt(head_dim))."""
    pattern = kv.get("gemma3.attention.sliding_window_pattern", _LLAMA_CPP_PATTERN)
    if isinstance(pattern, list):
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        config["sliding_window_pattern"] = pattern
    config.setdefault("rope_local_base_freq", 10000.0)
    config["query_pre_attn_scalar"] = config.get("head_dim", 256)
    return config


def from_gguf(weights: dict[str, mx.array], args: ModelArgs) -> dict[str, mx.array]:
    """llama.cpp stores Gemma's norm gains as `1 + w`; this module adds the 1 itself."""
    return {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in weights.items()}


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this architecture holds, with the shape `args` implies."""
    hidden, inter, head = args.hidden_size, args.intermediate_size, args.head_dim
    q_dim, kv_dim = args.num_attention_heads * head, args.num_key_value_heads * head
    top = args.prefix
    shapes: dict[str, tuple[int, ...]] = {f"{top}.embed_tokens.weight": (args.vocab_size, hidden),
                                          f"{top}.norm.weight": (hidden,)}
    if not args.tie_word_embeddings:
        shapes[f"{top.removesuffix('model')}lm_head.weight"] = (args.vocab_size, hidden)
    for i in range(args.num_hidden_layers):
        p = f"{top}.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.pre_feedforward_layernorm.weight": (hidden,),
            f"{p}.post_feedforward_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.self_attn.q_norm.weight": (head,),
            f"{p}.self_attn.k_norm.weight": (head,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    return shapes
