"""Mistral (model_type "mistral"; MistralForCausalLM): the Llama decoder, with sliding-window
attention when config.json sets `sliding_window` (Mistral 7B v0.1: 4096; later versions null).
Mistral GGUFs say `general.architecture = llama` and run through llama.py. Self-contained."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import Cache, KVCache, SlidingWindowCache
from runner.nn.attention import Attention
from runner.nn.embedding import Embedding
from runner.nn.linear import Linear
from runner.nn.norm import RMSNorm

ARCHITECTURES = ("MistralForCausalLM",)


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from config.json, ignoring the keys this architecture does not use."""
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.num_key_value_heads is not None and args.head_dim is not None
        self.self_attn = Attention(args.hidden_size, args.num_attention_heads,
                                   args.num_key_value_heads, args.head_dim, args.rope_theta,
                                   args.rope_scaling, window=args.sliding_window)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Cache | None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MistralModel(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None) -> mx.array:
        h = self.embed_tokens(inputs)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache[i] if cache is not None else None)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = MistralModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)

    def __call__(self, inputs: mx.array, cache: list[Cache] | None = None) -> mx.array:
        h = self.model(inputs, cache)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)

    def make_cache(self) -> list[Cache]:
        """With a sliding window every layer keeps only the window (memory bounded however
        long the context); such caches cannot rewind, so speculative decoding steps aside."""
        window = self.args.sliding_window
        if window is None:
            return [KVCache() for _ in self.layers]
        return [SlidingWindowCache(window) for _ in self.layers]

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop what HF checkpoints carry but inference never reads (rotary caches)."""
    return {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this architecture holds, with the shape `args` implies."""
    assert args.num_key_value_heads is not None and args.head_dim is not None
    hidden, inter, vocab = args.hidden_size, args.intermediate_size, args.vocab_size
    q_dim = args.num_attention_heads * args.head_dim
    kv_dim = args.num_key_value_heads * args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
    return shapes

