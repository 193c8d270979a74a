"""Gemma 3 with vision (model_type "gemma3"; Gemma3ForConditionalGeneration): a SigLIP vision
tower, the multimodal projector (average-pool the patch grid to `mm_tokens_per_image`, Gemma
RMSNorm, project to the text width), and the text model of `gemma3_text`, wrapped, not copied.

Image features replace the embeddings of the image tokens (`image_token_index`); those tokens
attend to each other in both directions, as the source model does (transformers' token_type_ids
mask, Ollama's), so a call that carries an image passes its [start, end) `spans`. A call without
spans runs the text model's own layers unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import KVCache
from runner.media.scatter import embed_with_images
from runner.models import gemma3_text as text
from runner.nn.attention import attend, span_mask
from runner.nn.linear import Linear

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
VISION_ARCHITECTURES = ARCHITECTURES
Span = tuple[int, int]
# transformers >= 4.52's Gemma3ForConditionalGeneration names -> the model's (the older names)
_NEWER_LAYOUT = (("model.language_model.", "language_model.model."),
                 ("model.vision_tower.", "vision_tower."),
                 ("model.multi_modal_projector.", "multi_modal_projector."),
                 ("lm_head.", "language_model.lm_head."))


@dataclass
class VisionArgs:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> VisionArgs:
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class ModelArgs:
    model_type: str
    text: text.ModelArgs
    vision: VisionArgs = field(default_factory=VisionArgs)
    mm_tokens_per_image: int = 256
    image_token_index: int = 262144
    boi_token_index: int = 255999
    eoi_token_index: int = 256000

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        vision = VisionArgs.from_dict(params.get("vision_config") or {})
        known = {k: params[k] for k in ("mm_tokens_per_image", "image_token_index",
                                        "boi_token_index", "eoi_token_index") if k in params}
        return cls(str(params.get("model_type") or "gemma3"),
                   text.ModelArgs.from_dict({**params, "model_type": "gemma3"}), vision, **known)

    def __getattr__(self, name: str) -> Any:
        """The text model's fields (hidden_size, tie_word_embeddings, ...), which the loader
        and create read from any architecture's args."""
        if name == "text":
            raise AttributeError(name)
        return getattr(self.text, name)

    @property
    def tokens_per_side(self) -> int:
        return round(self.mm_tokens_per_image ** 0.5)


class VisionAttention(nn.Module):
    def __init__(self, dims: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (Linear(dims, dims, bias=True) for _ in range(3))
        self.out_proj = Linear(dims, dims, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        b, n, d = x.shape
        q, k, v = (p(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = (d // self.heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, dims: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = Linear(dims, hidden, bias=True)
        self.fc2 = Linear(hidden, dims, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.self_attn = VisionAttention(args.hidden_size, args.num_attention_heads)
        self.mlp = VisionMLP(args.hidden_size, args.intermediate_size)
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(args.num_channels, args.hidden_size,
                                         args.patch_size, stride=args.patch_size)
        self.position_embedding = nn.Embedding(args.patches_per_side ** 2, args.hidden_size)

    def __call__(self, pixels: mx.array) -> mx.array:
        patches = self.patch_embedding(pixels)  # (B, H/p, W/p, D), channels last
        b, _, _, d = patches.shape
        return patches.reshape(b, -1, d) + self.position_embedding.weight


class VisionModel(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class VisionTower(nn.Module):
    """Named as the checkpoint names it: `vision_tower.vision_model.*`."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.vision_model = VisionModel(args)

    def __call__(self, pixels: mx.array) -> mx.array:
        return self.vision_model(pixels)


class Projector(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        vision = args.vision
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, args.text.hidden_size))
        self.mm_soft_emb_norm = text.RMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.side = vision.patches_per_side
        self.pool = self.side // args.tokens_per_side

    def __call__(self, features: mx.array) -> mx.array:
        b, _, d = features.shape
        out = self.side // self.pool
        grid = features.reshape(b, out, self.pool, out, self.pool, d)
        pooled = grid.mean(axis=(2, 4)).reshape(b, out * out, d)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Model(nn.Module):
    IMAGE_TEXT_AROUND = ("\n\n", "\n\n")  # Gemma3Processor's full_image_sequence

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = text.LanguageModel(args.text)
        self.vision_tower = VisionTower(args.vision)
        self.multi_modal_projector = Projector(args)
        self._bound: dict[int, mx.array] = {}

    def image_tokens(self) -> tuple[int, int, int]:
        """(start id, end id, tokens per image): what placeholder expansion writes."""
        args = self.args
        return args.boi_token_index, args.eoi_token_index, args.mm_tokens_per_image

    def image_size(self) -> int:
        return self.args.vision.image_size

    def bind_images(self, rows: dict[int, mx.array]) -> None:
        """The feature row of each image key (runner.media.prompt) the next calls may carry."""
        self._bound = rows

    @property
    def layers(self) -> list[text.DecoderLayer]:
        return self.language_model.model.layers

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, H, W, 3) normalised pixels -> (N, mm_tokens_per_image, text hidden) features."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def embed(self, inputs: mx.array, features: mx.array | None = None) -> mx.array:
        """Scaled token embeddings, the image tokens' replaced by `features` in order (or, for
        image keys, by their bound rows)."""
        decoder = self.language_model.model

        def scaled(ids: mx.array) -> mx.array:
            h = decoder.embed_tokens(ids)
            return h * mx.array(decoder.embed_scale, h.dtype)

        return embed_with_images(inputs, scaled, self.args.image_token_index, features,
                                 self._bound)

    def __call__(self, inputs: mx.array, cache: list[KVCache] | None = None,
                 spans: Sequence[Span] = (), features: mx.array | None = None) -> mx.array:
        decoder = self.language_model.model
        h = self.embed(inputs, features)
        for i, layer in enumerate(decoder.layers):
            layer_cache = cache[i] if cache is not None else None
            h = (_span_layer(layer, h, layer_cache, spans) if spans
                 else layer(h, layer_cache))
        h = decoder.norm(h)
        lm = self.language_model
        logits = lm.lm_head(h) if "lm_head" in lm else decoder.embed_tokens.as_linear(h)
        return text.softcap(logits, self.args.text.final_logit_softcapping)


def _span_layer(layer: text.DecoderLayer, x: mx.array, cache: KVCache | None,
                spans: Sequence[Span]) -> mx.array:
    """The text model's decoder layer, its attention masked with the image spans."""
    attended = _span_attention(layer.self_attn, layer.input_layernorm(x), cache, spans)
    h = x + layer.post_attention_layernorm(attended)
    return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


def _span_attention(attn: Any, x: mx.array, cache: KVCache | None,
                    spans: Sequence[Span]) -> mx.array:
    b, length, _ = x.shape
    q = attn._heads(attn.q_proj(x), attn.num_heads)
    k = attn._heads(attn.k_proj(x), attn.num_kv_heads)
    v = attn._heads(attn.v_proj(x), attn.num_kv_heads)
    q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    offset = cache.offset if cache is not None else 0
    q, k = attn.rope(q, offset), attn.rope(k, offset)
    if cache is not None:
        fetched = cache.update_and_fetch(k, v)
        k, v = fetched[0], fetched[1]
    first_key = offset + length - k.shape[2]  # a windowed cache may hold only the last keys
    mask = span_mask(length, k.shape[2], offset, first_key, spans, attn.window)
    out = attend(q, k, v, attn.scale, mask, attn.softcap)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


def tensor_name(name: str) -> str:
    """The model's name for a checkpoint tensor (or module path). Checkpoints saved by
    transformers before 4.52 use the model's own names; newer ones nest every part under
    `model.` and keep the head at the top (`model.language_model.layers.0...`,
    `model.vision_tower...`, `lm_head.weight`)."""
    for new, old in _NEWER_LAYOUT:
        if name == new.rstrip("."):  # a module path (`lm_head`)
            return old.rstrip(".")
        if name.startswith(new):
            return old + name[len(new):]
    return name


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Either layout's names as the model's (`tensor_name`); PyTorch's conv weight
    (out, in, kh, kw) -> MLX's (out, kh, kw, in); drop rotary caches."""
    out = {}
    for key, value in weights.items():
        if "rotary_emb.inv_freq" in key:
            continue
        if key.endswith("patch_embedding.weight") and value.ndim == 4 and value.shape[1] <= 4:
            value = value.transpose(0, 2, 3, 1)
        out[tensor_name(key)] = value
    return out


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The text model's tensors, the vision tower's and the projector's (PyTorch layout), under
    the model's names; create matches a checkpoint's names to these through `tensor_name`, so
    either transformers layout validates."""
    v = args.vision
    d, inter = v.hidden_size, v.intermediate_size
    top = "vision_tower.vision_model"
    shapes = dict(text.tensor_shapes(args.text))
    shapes.update({
        f"{top}.embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size,
                                                     v.patch_size),
        f"{top}.embeddings.patch_embedding.bias": (d,),
        f"{top}.embeddings.position_embedding.weight": (v.patches_per_side ** 2, d),
        f"{top}.post_layernorm.weight": (d,), f"{top}.post_layernorm.bias": (d,),
        "multi_modal_projector.mm_input_projection_weight": (d, args.text.hidden_size),
        "multi_modal_projector.mm_soft_emb_norm.weight": (d,),
    })
    for i in range(v.num_hidden_layers):
        p = f"{top}.encoder.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.self_attn.{name}.weight"] = (d, d)
            shapes[f"{p}.self_attn.{name}.bias"] = (d,)
        for name in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{name}.weight"] = (d,)
            shapes[f"{p}.{name}.bias"] = (d,)
        shapes.update({f"{p}.mlp.fc1.weight": (inter, d), f"{p}.mlp.fc1.bias": (inter,),
                       f"{p}.mlp.fc2.weight": (d, inter), f"{p}.mlp.fc2.bias": (d,)})
    return shapes
