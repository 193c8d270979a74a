"""Multi-head self-attention with grouped KV heads (GQA), RoPE and a causal mask.

Projections are `runner.nn.linear` layers (dense or quantized, decided at load); the optional
per-head `q_norm`/`k_norm` (Qwen3) are applied before RoPE. With a sliding `window` (Mistral,
Gemma 3's local layers) each query sees only the last `window` positions, itself included.
`mx.fast.scaled_dot_product_attention` broadcasts the KV heads over the query groups itself, so K
and V are never repeated in memory, and its "causal" mask is aligned to the end of the history,
which is what a cached prefill needs. A `SlidingWindowCache` keeps only the window and returns
the position of its first key, from which `window_mask` places the chunk's mask.

With `softcap` (Gemma 2/3's `attn_logit_softcapping`) the scores are squashed to
`tanh(s / cap) * cap` before the mask and softmax, which the fused kernel cannot do, so `attend`
computes those layers' attention from its equations (mlx-lm's gemma2.py), K and V still shared
across each query group rather than repeated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import Cache, SlidingWindowCache
from runner.nn.linear import Linear
from runner.nn.norm import RMSNorm
from runner.nn.rope import RoPE


def attention_mask(offset: int, length: int, window: int | None) -> mx.array | str | None:
    """Causal (and, past `window` positions, windowed) mask for `length` queries after
    `offset` cached positions."""
    total = offset + length
    if window is None or total <= window:
        return "causal" if length > 1 else None
    queries = mx.arange(offset, total)[:, None]
    keys = mx.arange(total)[None]
    return (keys <= queries) & (keys > queries - window)


def window_mask(offset: int, length: int, first: int, keys: int,
                window: int) -> mx.array | str | None:
    """Mask for `length` queries after `offset` over `keys` kept keys from position `first`
    (a sliding-window cache's). One query sees every key the cache returns."""
    if length == 1:
        return None
    if first == 0 and offset + length <= window:
        return "causal"
    queries = mx.arange(offset, offset + length)[:, None]
    positions = mx.arange(first, first + keys)[None]
    return (positions <= queries) & (positions > queries - window)


def span_mask(queries: int, keys: int, first_query: int, first_key: int,
              spans: Sequence[tuple[int, int]], window: int | None) -> mx.array:
    """Boolean mask: causal (within `window`), and both ways inside each span ([start, end)
    positions of this call's tokens)."""
    q = mx.arange(queries)[:, None] + first_query
    k = mx.arange(keys)[None, :] + first_key
    ok = k <= q
    if window is not None:
        ok = ok & (k > q - window)
    for start, end in spans:
        a, z = start + first_query, end + first_query
        ok = ok | ((q >= a) & (q < z) & (k >= a) & (k < z))
    return ok


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None,
           softcap: float | None = None) -> mx.array:
    """Attention of q (B, H, L, D) over k, v (B, H_kv, K, D); `mask` is None, "causal" (aligned
    to the end of the keys) or a boolean (L, K) array. Soft-capped when `softcap` is set."""
    if not softcap:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    q = (q * scale).reshape(batch, kv_heads, heads // kv_heads, length, dim)
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # (B, H_kv, groups, L, K)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):  # "causal": query i is position keys - length + i
        mask = mx.arange(keys)[None] <= mx.arange(keys - length, keys)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(v, 2)).reshape(batch, heads, length, dim)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, rope_scaling: dict[str, Any] | None = None,
                 bias: bool = False, qk_norm_eps: float | None = None,
                 o_bias: bool | None = None, scale: float | None = None,
                 window: int | None = None,
                 qk_norm: Callable[[int, float], nn.Module] = RMSNorm,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.window = window
        self.softcap = softcap
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size,
                             bias=bias if o_bias is None else o_bias)
        if qk_norm_eps is not None:
            self.q_norm = qk_norm(head_dim, qk_norm_eps)
            self.k_norm = qk_norm(head_dim, qk_norm_eps)
        self.rope = RoPE(head_dim, rope_theta, rope_scaling)

    def _heads(self, x: mx.array, heads: int) -> mx.array:
        batch, length, _ = x.shape
        return x.reshape(batch, length, heads, self.head_dim)

    def __call__(self, x: mx.array, cache: Cache | None = None) -> mx.array:
        batch, length, _ = x.shape
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if isinstance(cache, SlidingWindowCache):
            k, v, first = cache.update_and_fetch(k, v)
            mask = window_mask(offset, length, first, k.shape[2], cache.window)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)  # type: ignore[union-attr]
            mask = attention_mask(offset, length, self.window)
        out = attend(q, k, v, self.scale, mask, self.softcap)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
