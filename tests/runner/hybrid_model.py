"""A tiny hybrid model for the prefix-cache tests: Mamba2 (`M`, runner.nn.ssm), full attention
(`*`, causal except inside non-causal spans, where tokens see each other both ways), sliding-
window attention (`W`, runner.kv_cache.SlidingWindowCache) and MLP (`-`) layers, random weights
from a seed. It takes `spans` the way a vision model will ([start, end) positions of this call's
tokens), so the trie's span rules are exercised before any real media exists."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from runner.kv_cache import KVCache, RecurrentCache, SlidingWindowCache
from runner.nn.attention import span_mask
from runner.nn.embedding import Embedding
from runner.nn.linear import Linear
from runner.nn.norm import RMSNorm
from runner.nn.ssm import Mamba2Mixer

HIDDEN, HEADS, HEAD_DIM, VOCAB, WINDOW = 64, 4, 16, 256, 6


def _allowed(queries: int, keys: int, first_query: int, first_key: int,
             spans: Sequence[tuple[int, int]], window: int | None) -> mx.array:
    """Additive mask: causal (within `window` if set), plus both ways inside each span."""
    return mx.where(span_mask(queries, keys, first_query, first_key, spans, window), 0.0, -mx.inf)


class SpanAttention(nn.Module):
    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.q_proj = Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = Linear(HIDDEN, HEADS * HEAD_DIM)
        self.v_proj = Linear(HIDDEN, HEADS * HEAD_DIM)
        self.o_proj = Linear(HEADS * HEAD_DIM, HIDDEN)

    def __call__(self, x: mx.array, cache, spans: Sequence[tuple[int, int]]) -> mx.array:
        b, length, _ = x.shape
        q, k, v = (p(x).reshape(b, length, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        first_query = cache.offset
        if isinstance(cache, SlidingWindowCache):
            k, v, first_key = cache.update_and_fetch(k, v)
        else:
            k, v = cache.update_and_fetch(k, v)
            first_key = 0
        mask = _allowed(length, k.shape[2], first_query, first_key, spans, self.window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, length, -1))


class Layer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(HIDDEN)
        if kind == "M":
            self.mixer = Mamba2Mixer(HIDDEN, 4, 16, 2, 8, 4, 1e-5, (0.0, float("inf")))
        elif kind in "*W":
            self.mixer = SpanAttention(WINDOW if kind == "W" else None)
        else:
            self.up, self.down = Linear(HIDDEN, 2 * HIDDEN), Linear(2 * HIDDEN, HIDDEN)

    def __call__(self, x: mx.array, cache, spans) -> mx.array:
        h = self.norm(x)
        if self.kind == "M":
            return x + self.mixer(h, cache)
        if self.kind in "*W":
            return x + self.mixer(h, cache, spans)
        return x + self.down(nn.relu2(self.up(h)))


class HybridModel(nn.Module):
    def __init__(self, pattern: str = "M*W-M*", seed: int = 0) -> None:
        super().__init__()
        self.embed = Embedding(VOCAB, HIDDEN)
        self.layers = [Layer(kind) for kind in pattern]
        self.out = Linear(HIDDEN, VOCAB)
        self._randomize(seed)

    def _randomize(self, seed: int) -> None:
        key = mx.random.key(seed)
        params = []
        for name, value in tree_flatten(self.parameters()):
            key, sub = mx.random.split(key)
            if name.endswith("A_log"):
                new = mx.log(mx.random.uniform(1.0, 8.0, value.shape, key=sub))
            elif name.endswith("dt_bias"):
                new = mx.random.uniform(-3.0, -1.0, value.shape, key=sub)
            elif "norm" in name or name.endswith(".D"):
                new = 1.0 + 0.1 * mx.random.normal(value.shape, key=sub)
            elif "conv1d" in name:
                new = 0.3 * mx.random.normal(value.shape, key=sub)
            else:
                new = 0.15 * mx.random.normal(value.shape, key=sub)
            params.append((name, new))
        self.update(tree_unflatten(params))
        mx.eval(self.parameters())

    def __call__(self, inputs: mx.array, cache=None, spans: Sequence[tuple[int, int]] = ()
                 ) -> mx.array:
        cache = cache if cache is not None else self.make_cache()
        caches = iter(cache)
        h = self.embed(inputs)
        for layer in self.layers:
            h = layer(h, next(caches) if layer.kind != "-" else None, spans)
        return self.out(h)

    def make_cache(self) -> list:
        kinds = {"M": RecurrentCache, "*": KVCache, "W": lambda: SlidingWindowCache(WINDOW)}
        return [kinds[layer.kind]() for layer in self.layers if layer.kind != "-"]
