"""Per-layer KV cache that grows in 256-token steps (reference 3.3).

Keys and values live in preallocated buffers of shape [batch, kv_heads, capacity, head_dim];
a write of L tokens past capacity first trims the buffers to the live offset, then appends zeros
for ceil(L/256)*256 more slots. Writes are slice updates; reads return the live prefix. Growing
in steps keeps decode from reallocating the whole history every token.

Rewinding (speculative decoding, the prefix cache) only moves the offset: slots past it are
overwritten by the next write. `part` hands out positions [a, b) as views of the buffer (the
prefix cache copies out what it keeps) and `load` starts a cache from such parts.

Layers that cannot rewind keep whole states instead: `RecurrentCache` (Mamba2's conv and SSM
state) and `SlidingWindowCache` (only the last `window` positions). A snapshot of either is valid
only at the offset it was taken at; `rewindable` tells the prefix cache which kind a layer is.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class KVCache:
    rewindable = True

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append L new positions; return the whole history [0, offset+L)."""
        length = keys.shape[2]
        if self.offset + length > self.capacity:
            self._grow(keys, values, length)
        assert self.keys is not None and self.values is not None
        end = self.offset + length
        self.keys[..., self.offset:end, :] = keys
        self.values[..., self.offset:end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _grow(self, keys: mx.array, values: mx.array, length: int) -> None:
        batch, heads, _, k_dim = keys.shape
        extra = -(-length // STEP) * STEP
        new_k = mx.zeros((batch, heads, extra, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, extra, values.shape[3]), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
            return
        live_k = self.keys[..., :self.offset, :]
        live_v = self.values[..., :self.offset, :]
        self.keys = mx.concatenate([live_k, new_k], axis=2)
        self.values = mx.concatenate([live_v, new_v], axis=2)

    @property
    def state(self) -> list[mx.array]:
        """The arrays to evaluate so that the cache holds no lazy graph."""
        return [a for a in (self.keys, self.values) if a is not None]

    def nbytes(self) -> int:
        """Bytes held, spare capacity included (what keeping this cache alive costs)."""
        return sum(a.nbytes for a in self.state)

    def rewind(self, length: int) -> None:
        """Forget every position from `length` on (never moves forward)."""
        self.offset = max(0, min(self.offset, length))

    def part(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Positions [start, end) as views of the live buffers (no copy)."""
        assert self.keys is not None and self.values is not None and end <= self.offset
        return self.keys[..., start:end, :], self.values[..., start:end, :]

    def load(self, parts: list[tuple[mx.array, mx.array]]) -> None:
        """Start from consecutive parts (positions 0..n); the next write grows the buffer."""
        if parts:
            self.keys = mx.concatenate([k for k, _ in parts], axis=2)
            self.values = mx.concatenate([v for _, v in parts], axis=2)
            self.offset = self.keys.shape[2]


class RecurrentCache:
    """A recurrent layer's whole state (Mamba2: conv history and SSM state) after `offset`
    tokens. It cannot be rewound into the past, only replaced: a snapshot is the pair of arrays
    as they are (the layer swaps in new arrays each call, never writes into old ones, so a
    snapshot costs no copy)."""

    rewindable = False

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.ssm: mx.array | None = None
        self.offset = 0

    def update(self, conv: mx.array, ssm: mx.array, length: int) -> None:
        self.conv, self.ssm = conv, ssm
        self.offset += length

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv, self.ssm) if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def snapshot(self) -> tuple[mx.array | None, mx.array | None, int]:
        """The state as it is; copied, because the conv history is a view of the last call's
        whole input, which a kept snapshot would otherwise keep alive."""
        return _copied(self.conv), _copied(self.ssm), self.offset

    def restore(self, snapshot: tuple[mx.array | None, mx.array | None, int]) -> None:
        self.conv, self.ssm, self.offset = snapshot


class SlidingWindowCache:
    """Keys and values of the last `window` positions only (sliding-window attention). A query
    at position p sees keys in (p - window, p]; `update_and_fetch` returns the kept keys with
    the new ones and the position of the first, from which the layer builds its mask."""

    rewindable = False

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array,
                         values: mx.array) -> tuple[mx.array, mx.array, int]:
        if self.keys is not None and self.values is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        first = self.offset - (0 if self.keys is None else self.keys.shape[2])
        self.offset = first + keys.shape[2]
        cut = keys.shape[2] - min(self.window - 1, keys.shape[2])
        self.keys, self.values = keys[..., cut:, :], values[..., cut:, :]
        return keys, values, first

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def snapshot(self) -> tuple[mx.array | None, mx.array | None, int]:
        """Copied, as `RecurrentCache.snapshot`: the kept keys are a view of the last call's."""
        return _copied(self.keys), _copied(self.values), self.offset

    def restore(self, snapshot: tuple[mx.array | None, mx.array | None, int]) -> None:
        self.keys, self.values, self.offset = snapshot


Cache = KVCache | RecurrentCache | SlidingWindowCache


def _copied(array: mx.array | None) -> mx.array | None:
    """A copy that owns its memory (a slice shares, and keeps alive, its source's buffer),
    evaluated now: a lazy copy would keep its source alive until first read."""
    if array is None:
        return None
    copy = mx.contiguous(array)
    mx.eval(copy)
    return copy


def new_caches(model: object) -> list[Cache]:
    """A fresh cache per layer that keeps one: the model's own kinds when it declares them
    (`make_cache`, hybrid models), else a KVCache per layer."""
    make = getattr(model, "make_cache", None)
    if make is not None:
        return make()
    return [KVCache() for _ in model.layers]  # type: ignore[attr-defined]
