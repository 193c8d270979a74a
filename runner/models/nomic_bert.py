"""Nomic BERT (model_type "nomic_bert"; NomicBertModel): a post-norm bidirectional encoder with
rotary positions instead of learned ones, a fused QKV projection and a SwiGLU MLP
(`fc2(fc11(x) * silu(fc12(x)))`), as in nomic-embed-text. Self-contained, as in mlx-lm.

Its config.json uses GPT-2 key names (`n_embd`, `n_layer`, `n_head`, `n_inner`); positions are
rotated over `rotary_emb_fraction` of each head (non-interleaved halves, base
`rotary_emb_base`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.nn.embedding import Embedding
from runner.nn.linear import Linear

ARCHITECTURES = ("NomicBertModel",)
EMBEDDING_ARCHITECTURES = ARCHITECTURES
DEFAULT_POOLING = "mean"


@dataclass
class ModelArgs:
    model_type: str
    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_inner: int | None = None
    n_positions: int = 2048
    type_vocab_size: int = 2
    layer_norm_epsilon: float = 1e-12
    rotary_emb_fraction: float = 1.0
    rotary_emb_base: float = 10000.0
    rotary_emb_interleaved: bool = False
    qkv_proj_bias: bool = False
    mlp_fc1_bias: bool = False
    mlp_fc2_bias: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from config.json, ignoring the keys this architecture does not use."""
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})

    def __post_init__(self) -> None:
        if self.n_inner is None:
            self.n_inner = 4 * self.n_embd


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a NomicBertModel checkpoint must hold, with the shape config.json implies."""
    d, inner = args.n_embd, int(args.n_inner or 0)
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (args.vocab_size, d),
        "emb_ln.weight": (d,), "emb_ln.bias": (d,)}
    if args.type_vocab_size > 0:
        shapes["embeddings.token_type_embeddings.weight"] = (args.type_vocab_size, d)
    for i in range(args.n_layer):
        p = f"encoder.layers.{i}"
        shapes.update({
            f"{p}.attn.Wqkv.weight": (3 * d, d), f"{p}.attn.out_proj.weight": (d, d),
            f"{p}.mlp.fc11.weight": (inner, d), f"{p}.mlp.fc12.weight": (inner, d),
            f"{p}.mlp.fc2.weight": (d, inner),
            f"{p}.norm1.weight": (d,), f"{p}.norm1.bias": (d,),
            f"{p}.norm2.weight": (d,), f"{p}.norm2.bias": (d,)})
        if args.qkv_proj_bias:
            shapes.update({f"{p}.attn.Wqkv.bias": (3 * d,), f"{p}.attn.out_proj.bias": (d,)})
    return shapes


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.n_embd)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = Embedding(args.type_vocab_size, args.n_embd)

    def __call__(self, ids: mx.array) -> mx.array:
        h = self.word_embeddings(ids)
        if "token_type_embeddings" in self:
            h = h + self.token_type_embeddings(mx.zeros_like(ids))
        return h


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.heads = args.n_head
        head_dim = args.n_embd // args.n_head
        self.scale = head_dim ** -0.5
        self.rotary_dims = int(head_dim * args.rotary_emb_fraction)
        self.rotary_base = args.rotary_emb_base
        self.traditional = args.rotary_emb_interleaved
        self.Wqkv = Linear(args.n_embd, 3 * args.n_embd, bias=args.qkv_proj_bias)
        self.out_proj = Linear(args.n_embd, args.n_embd, bias=args.qkv_proj_bias)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, dims = x.shape
        qkv = self.Wqkv(x).reshape(batch, length, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.rotary_dims:
            q, k = (mx.fast.rope(t, self.rotary_dims, traditional=self.traditional,
                                 base=self.rotary_base, scale=1.0, offset=0) for t in (q, k))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, dims))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        inner = int(args.n_inner or 0)
        self.fc11 = Linear(args.n_embd, inner, bias=args.mlp_fc1_bias)
        self.fc12 = Linear(args.n_embd, inner, bias=args.mlp_fc1_bias)
        self.fc2 = Linear(inner, args.n_embd, bias=args.mlp_fc2_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.fc11(x) * nn.silu(self.fc12(x)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attn = Attention(args)
        self.mlp = MLP(args)
        self.norm1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.norm2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.norm1(x + self.attn(x, mask))
        return self.norm2(h + self.mlp(h))


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layers = [Block(args) for _ in range(args.n_layer)]


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.config = args
        self.model_type = args.model_type
        self.max_tokens = args.n_positions
        self.embeddings = Embeddings(args)
        self.emb_ln = nn.LayerNorm(args.n_embd, eps=args.layer_norm_epsilon)
        self.encoder = Encoder(args)

    def embed(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Last hidden states [batch, length, hidden] of right-padded `ids` (`mask` 1 on real
        tokens); rotary positions count from 0 in every row, so right padding changes nothing."""
        h = self.emb_ln(self.embeddings(ids))
        keys = mask.astype(mx.bool_)[:, None, None, :]
        for layer in self.encoder.layers:
            h = layer(h, keys)
        return h

    @property
    def layers(self) -> list[Block]:
        return self.encoder.layers


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop the position-id buffers some exports carry."""
    return {k: v for k, v in weights.items() if not k.endswith("position_ids")}
