"""Per-layer KV cache that grows in 256-token steps (reference 3.3).

Keys and values live in preallocated buffers of shape [batch, kv_heads, capacity, head_dim];
a write of L tokens past capacity first trims the buffers to the live offset, then appends zeros
for ceil(L/256)*256 more slots. Writes are slice updates; reads return the live prefix. Growing
in steps keeps decode from reallocating the whole history every token.

Rewinding (speculative decoding, the prefix cache) only moves the offset: slots past it are
overwritten by the next write. `part` hands out positions [a, b) as views of the buffer (the
prefix cache copies out what it keeps apart from the live buffer) and `load` starts a cache from
such parts. `reserve` and `append` serve a compiled decode graph that reads the whole buffer.

Layers that cannot rewind keep whole states instead: `RecurrentCache` (Mamba2's conv and SSM
state) and `SlidingWindowCache` (only the last `window` positions). A snapshot of either is valid
only at the offset it was taken at; `rewindable` tells the prefix cache which kind a layer is.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256


class KVCache:
    rewindable = True
    undoes_verify = True  # speculation can take back a verify pass (runner/speculative.py)

    def __init__(self, dtype: mx.Dtype | None = None) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.dtype = dtype  # what the buffers hold; None: the first write's dtype

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append L new positions; return the whole history [0, offset+L)."""
        self.append(keys, values)
        assert self.keys is not None and self.values is not None
        return self.keys[..., :self.offset, :], self.values[..., :self.offset, :]

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Write L new positions at the offset (in place: a slice update of the buffers)."""
        length = keys.shape[2]
        if self.offset + length > self.capacity:
            self._grow(keys, values, length)
        assert self.keys is not None and self.values is not None
        end = self.offset + length
        self.keys[..., self.offset:end, :] = keys
        self.values[..., self.offset:end, :] = values
        self.offset = end

    def reserve(self, length: int) -> None:
        """Make room for `length` more positions now (a compiled decode graph reads the whole
        buffer, with the slots past the offset masked, and writes the new position after)."""
        assert self.keys is not None and self.values is not None
        if self.offset + length > self.capacity:
            self._grow(self.keys, self.values, length)

    def _grow(self, keys: mx.array, values: mx.array, length: int) -> None:
        batch, heads, _, k_dim = keys.shape
        extra = -(-length // STEP) * STEP
        new_k = mx.zeros((batch, heads, extra, k_dim), self.dtype or keys.dtype)
        new_v = mx.zeros((batch, heads, extra, values.shape[3]), self.dtype or values.dtype)
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
    snapshot costs no copy).

    Speculative decoding must take back the rejected part of a verify pass: with `keep_steps`
    on, the layer runs a multi-token call one token at a time and hands every intermediate
    state to `record`, so `rewind` to any position of that call is a pick, no recompute (as
    Ollama restores per-token snapshots of caches that cannot rewind)."""

    rewindable = False
    undoes_verify = True

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.ssm: mx.array | None = None
        self.offset = 0
        self.keep_steps = False
        self._steps: list[tuple[mx.array, mx.array]] = []  # state after 0..L tokens
        self._steps_from = 0  # the offset of _steps[0]

    def update(self, conv: mx.array, ssm: mx.array, length: int) -> None:
        self.conv, self.ssm = conv, ssm
        self.offset += length
        self._steps = []

    def record(self, states: list[tuple[mx.array, mx.array]]) -> None:
        """A stepwise call's states, before it (first) and after each of its tokens."""
        start = self.offset
        self.update(*states[-1], len(states) - 1)
        self._steps, self._steps_from = states, start

    def rewind(self, length: int) -> None:
        """Back to `length` tokens: only within the last recorded call (or a no-op)."""
        if length >= self.offset:
            return
        if not self._steps_from <= length < self._steps_from + len(self._steps):
            raise ValueError(f"a recurrent state at {self.offset} cannot go back to {length}")
        self.conv, self.ssm = self._steps[length - self._steps_from]
        self.offset = length
        self._steps = []

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
        self._steps = []


class SlidingWindowCache:
    """Keys and values of the last `window` positions only (sliding-window attention): a
    layer's memory stays bounded by its window however long the sequence grows.

    A query at position p sees keys in (p - window, p]. A chunk of several queries (prefill)
    gets the kept keys followed by its own, in position order, with the position of the first,
    from which the layer builds its mask; afterwards the last `window - 1` positions are kept
    (all a later query can see besides itself), copied so the chunk's keys are freed. A single
    query (decode) is written in place into a ring of `window` slots, so decode never copies
    the window; every key it returns is visible to it, so it needs no mask and the ring's order
    does not matter (RoPE is already applied)."""

    rewindable = False
    undoes_verify = False

    def __init__(self, window: int) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self._size = 0  # positions held: [offset - size, offset)
        self._start = 0  # ring slot of the oldest held position; 0 unless the ring is full
        self._borrowed = False  # keys are a snapshot's arrays, never to be written into

    def update_and_fetch(self, keys: mx.array,
                         values: mx.array) -> tuple[mx.array, mx.array, int]:
        """The keys and values the new queries attend over, and the first one's position."""
        if keys.shape[2] == 1:
            return self._step(keys, values)
        return self._chunk(keys, values)

    def _chunk(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        first = self.offset - self._size
        if self._size:
            kept_k, kept_v = self._ordered()
            keys = mx.concatenate([kept_k, keys], axis=2)
            values = mx.concatenate([kept_v, values], axis=2)
        self.offset = first + keys.shape[2]
        cut = keys.shape[2] - min(self.window - 1, keys.shape[2])
        self.keys = mx.contiguous(keys[..., cut:, :])
        self.values = mx.contiguous(values[..., cut:, :])
        self._size, self._start, self._borrowed = keys.shape[2] - cut, 0, False
        return keys, values, first

    def _step(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        if self.keys is None or self.keys.shape[2] < self.window or self._borrowed:
            self._reserve(keys, values)
        assert self.keys is not None and self.values is not None
        full = self._size == self.window
        slot = self._start if full else self._size
        self.keys[..., slot:slot + 1, :] = keys
        self.values[..., slot:slot + 1, :] = values
        if full:
            self._start = (self._start + 1) % self.window
        else:
            self._size += 1
        self.offset += 1
        held = self._size
        return self.keys[..., :held, :], self.values[..., :held, :], self.offset - held

    def _reserve(self, keys: mx.array, values: mx.array) -> None:
        """The ring's `window` slots, the held positions first (in order)."""
        batch, heads, _, k_dim = keys.shape
        spare = self.window - self._size
        new_k = mx.zeros((batch, heads, spare, k_dim), keys.dtype)
        new_v = mx.zeros((batch, heads, spare, values.shape[3]), values.dtype)
        if self._size:
            kept_k, kept_v = self._ordered()
            new_k = mx.concatenate([kept_k, new_k], axis=2)
            new_v = mx.concatenate([kept_v, new_v], axis=2)
        self.keys, self.values, self._start, self._borrowed = new_k, new_v, 0, False

    def _ordered(self) -> tuple[mx.array, mx.array]:
        """The held positions, oldest first."""
        assert self.keys is not None and self.values is not None
        if self._start == 0:
            return self.keys[..., :self._size, :], self.values[..., :self._size, :]
        s = self._start
        return (mx.concatenate([self.keys[..., s:, :], self.keys[..., :s, :]], axis=2),
                mx.concatenate([self.values[..., s:, :], self.values[..., :s, :]], axis=2))

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def held(self) -> int:
        """Positions kept (at most `window`)."""
        return self._size

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def snapshot(self) -> tuple[mx.array | None, mx.array | None, int]:
        """The held positions in order, copied (the ring is written in place, and kept keys
        may be a view of a larger buffer)."""
        if not self._size:
            return None, None, self.offset
        keys, values = self._ordered()
        return _copied(keys), _copied(values), self.offset

    def restore(self, snapshot: tuple[mx.array | None, mx.array | None, int]) -> None:
        self.keys, self.values, self.offset = snapshot
        self._size = 0 if self.keys is None else self.keys.shape[2]
        self._start, self._borrowed = 0, True


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
    (`make_cache`, hybrid models), else a KVCache per layer. A model's `kv_dtype` (the loader
    sets it on the fused path) is what its KVCaches store."""
    make = getattr(model, "make_cache", None)
    layers = getattr(model, "layers", [])
    caches = make() if make is not None else [KVCache() for _ in layers]
    kv_dtype = getattr(model, "kv_dtype", None)  # set by the loader (runner/load.py)
    for cache in caches:
        if kv_dtype is not None and isinstance(cache, KVCache):
            cache.dtype = kv_dtype
    return caches
