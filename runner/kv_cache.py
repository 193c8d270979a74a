"""Per-layer KV cache that grows in 256-token steps (reference 3.3).

Keys and values live in preallocated buffers of shape [batch, kv_heads, capacity, head_dim];
a write of L tokens past capacity first trims the buffers to the live offset, then appends zeros
for ceil(L/256)*256 more slots. Writes are slice updates; reads return the live prefix. Growing
in steps keeps decode from reallocating the whole history every token.

Rewinding (speculative decoding, the prefix cache) only moves the offset: slots past it are
overwritten by the next write. `prefix_copy` hands out an independent cache holding a copy of the
first n positions, so a cached snapshot never shares a buffer that a later write updates.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class KVCache:
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

    def prefix_copy(self, length: int) -> KVCache:
        """A new cache holding copies of positions [0, length); its first write grows it."""
        copy = KVCache()
        length = min(length, self.offset)
        if length > 0 and self.keys is not None and self.values is not None:
            copy.keys = mx.contiguous(self.keys[..., :length, :])
            copy.values = mx.contiguous(self.values[..., :length, :])
            copy.offset = length
        return copy


class RecurrentCache:
    """A recurrent layer's whole state (Mamba2: conv history and SSM state) after `offset`
    tokens. It cannot be rewound into the past, only replaced: a snapshot is the pair of arrays
    as they are (the layer swaps in new arrays each call, never writes into old ones, so a
    snapshot costs no copy)."""

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
