"""BERT (model_type "bert"; BertModel): a post-norm bidirectional encoder with learned absolute
positions and token types, used for sentence embeddings. Self-contained, as in mlx-lm.

`Model.embed(ids, mask)` returns the last hidden states of a right-padded batch; padding is kept
out of attention by the key mask, so each row's states are those of its own text alone. Pooling
(mean or CLS) is the caller's (runner/embed.py), as sentence-transformers' 1_Pooling does it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.nn.embedding import Embedding
from runner.nn.linear import Linear

ARCHITECTURES = ("BertModel",)
EMBEDDING_ARCHITECTURES = ARCHITECTURES
DEFAULT_POOLING = "cls"  # what BERT's own pooler reads, when no 1_Pooling config says otherwise


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        """Build from config.json, ignoring the keys this architecture does not use."""
        known = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in known})


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a BertModel checkpoint must hold, with the shape config.json implies."""
    d, inner = args.hidden_size, args.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (args.vocab_size, d),
        "embeddings.position_embeddings.weight": (args.max_position_embeddings, d),
        "embeddings.token_type_embeddings.weight": (args.type_vocab_size, d),
        "embeddings.LayerNorm.weight": (d,), "embeddings.LayerNorm.bias": (d,)}
    for i in range(args.num_hidden_layers):
        p = f"encoder.layer.{i}"
        for proj in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            shapes.update({f"{p}.{proj}.weight": (d, d), f"{p}.{proj}.bias": (d,)})
        shapes.update({
            f"{p}.intermediate.dense.weight": (inner, d), f"{p}.intermediate.dense.bias": (inner,),
            f"{p}.output.dense.weight": (d, inner), f"{p}.output.dense.bias": (d,)})
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes.update({f"{p}.{norm}.weight": (d,), f"{p}.{norm}.bias": (d,)})
    return shapes


def activation(name: str) -> Any:
    """HF's `hidden_act` names: "gelu" is the exact (erf) GELU, the `_new`/tanh ones approximate."""
    table = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx,
             "relu": nn.relu, "silu": nn.silu}
    if name not in table:
        raise ValueError(f"unsupported hidden_act {name!r}")
    return table[name]


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, ids: mx.array, positions: mx.array) -> mx.array:
        types = mx.zeros_like(ids)
        h = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(types))
        return self.LayerNorm(h)


class SelfAttention(nn.Module):
    def __init__(self, dims: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = Linear(dims, dims, bias=True)
        self.key = Linear(dims, dims, bias=True)
        self.value = Linear(dims, dims, bias=True)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, dims = x.shape
        q, k, v = (p(x).reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)
                   for p in (self.query, self.key, self.value))
        scale = (dims // self.heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, dims)


class DenseNorm(nn.Module):
    """BERT's `output` blocks: dense, then LayerNorm over the residual sum."""

    def __init__(self, inputs: int, dims: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(inputs, dims, bias=True)
        self.LayerNorm = nn.LayerNorm(dims, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self["self"] = SelfAttention(args.hidden_size, args.num_attention_heads)
        self.output = DenseNorm(args.hidden_size, args.hidden_size, args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self["self"](x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.act = activation(args.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Intermediate(args)
        self.output = DenseNorm(args.intermediate_size, args.hidden_size, args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = [Layer(args) for _ in range(args.num_hidden_layers)]


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.config = args
        self.model_type = args.model_type
        self.max_tokens = args.max_position_embeddings
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)

    def positions(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Absolute positions 0..L-1 for every row (right padding keeps them aligned)."""
        return mx.broadcast_to(mx.arange(ids.shape[1]), ids.shape)

    def embed(self, ids: mx.array, mask: mx.array) -> mx.array:
        """Last hidden states [batch, length, hidden] of right-padded `ids`; `mask` is 1 on
        real tokens, 0 on padding."""
        h = self.embeddings(ids, self.positions(ids, mask))
        keys = mask.astype(mx.bool_)[:, None, None, :]
        for layer in self.encoder.layer:
            h = layer(h, keys)
        return h

    @property
    def layers(self) -> list[Layer]:
        return self.encoder.layer


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Drop what inference never reads (the position-id buffer, the NSP pooler) and the `bert.`
    prefix that checkpoints saved from a task head carry."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("bert.")
        if key.startswith("pooler.") or key.endswith("position_ids"):
            continue
        out[key] = value
    return out
