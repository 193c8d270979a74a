"""Mamba2's selective state-space layer: in-projection, causal conv, selective scan, gated norm.

The scan has two forms with one meaning. Prefill runs the SSD "chunked scan": within a chunk of
`SCAN_CHUNK` steps the output is a masked, decay-weighted attention-like product (matmuls), and
the state crosses chunk boundaries once per chunk, so a prompt costs len/SCAN_CHUNK small loops
instead of a Python loop per token. Decode runs the single-step recurrence
    state = exp(dt*A) * state + dt * x (x) B ;  y = state . C + D * x
Both compute in float32 whatever the weights are (the decays are exponentials of sums).
State per layer: the conv history [batch, kernel-1, conv_dim] and the SSM state
[batch, heads, head_dim, state_size] (runner.kv_cache.RecurrentCache).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from runner.nn.conv import CausalConv1d
from runner.nn.linear import Linear

SCAN_CHUNK = 128


def time_steps(dt: mx.array, dt_bias: mx.array, limit: tuple[float, float]) -> mx.array:
    """softplus(dt + bias), clipped to the config's time_step_limit, in float32."""
    dt = nn.softplus(dt.astype(mx.float32) + dt_bias.astype(mx.float32))
    return mx.clip(dt, limit[0], limit[1])


def _by_head(t: mx.array, heads: int) -> mx.array:
    """[batch, length, groups, n] -> [batch, heads, length, n], each group serving heads/groups
    consecutive heads."""
    return mx.repeat(t, heads // t.shape[2], axis=2).transpose(0, 2, 1, 3)


def scan_chunk(x: mx.array, dt: mx.array, log_a: mx.array, b: mx.array, c: mx.array,
               state: mx.array | None) -> tuple[mx.array, mx.array]:
    """One SSD chunk. x [B,L,H,P], dt [B,L,H], log_a [H] (= -exp(A_log)), b/c [B,L,G,N],
    state [B,H,P,N] or None. Returns y [B,L,H,P] (without the D skip) and the end state."""
    heads = x.shape[2]
    da = (dt * log_a).transpose(0, 2, 1)  # [B,H,L] log decay per step
    cum = mx.cumsum(da, axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]  # [B,H,L,L]: decay from step j to step i
    length = x.shape[1]
    causal = mx.tril(mx.ones((length, length), dtype=mx.bool_))
    decay = mx.exp(mx.where(causal, diff, -mx.inf))
    bh, ch = _by_head(b, heads), _by_head(c, heads)  # [B,H,L,N]
    dtx = (dt[..., None] * x).transpose(0, 2, 1, 3)  # [B,H,L,P]
    y = ((ch @ bh.swapaxes(-1, -2)) * decay) @ dtx  # [B,H,L,P]
    to_end = mx.exp(cum[..., -1:] - cum)[..., None]  # [B,H,L,1]
    new_state = (dtx * to_end).swapaxes(-1, -2) @ bh  # [B,H,P,N]
    if state is not None:
        y = y + mx.exp(cum)[..., None] * (ch @ state.swapaxes(-1, -2))
        new_state = new_state + mx.exp(cum[..., -1])[..., None, None] * state
    return y.transpose(0, 2, 1, 3), new_state


def scan(x: mx.array, dt: mx.array, log_a: mx.array, b: mx.array, c: mx.array,
         state: mx.array | None, chunk: int = SCAN_CHUNK) -> tuple[mx.array, mx.array]:
    """The chunked scan over a whole prefill; same arguments as `scan_chunk`."""
    ys = []
    for i in range(0, x.shape[1], chunk):
        y, state = scan_chunk(x[:, i:i + chunk], dt[:, i:i + chunk], log_a,
                              b[:, i:i + chunk], c[:, i:i + chunk], state)
        ys.append(y)
    assert state is not None
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), state


def step(x: mx.array, dt: mx.array, log_a: mx.array, b: mx.array, c: mx.array,
         state: mx.array | None) -> tuple[mx.array, mx.array]:
    """The single-token recurrence (length 1), same arguments and results as `scan_chunk`."""
    heads = x.shape[2]
    bh, ch = _by_head(b, heads)[:, :, 0], _by_head(c, heads)[:, :, 0]  # [B,H,N]
    dt0 = dt[:, 0]  # [B,H]
    update = (dt0[..., None] * x[:, 0])[..., None] * bh[:, :, None, :]  # [B,H,P,N]
    if state is not None:
        update = update + mx.exp(dt0 * log_a)[..., None, None] * state
    y = (update @ ch[..., None])[..., 0]  # [B,H,P]
    return y[:, None], update


def decode_step(heads: int, head_dim: int, groups: int, state_size: int,
                limit: tuple[float, float], eps: float) -> Callable[..., tuple[mx.array, ...]]:
    """The whole mixer between its two projections for one token: the conv over the history,
    the recurrence and the gated norm. Compiled (alone, or inside a model's whole decode graph)
    they fuse into a few kernels, where op by op they are ~40 small dispatches per layer."""
    inner = heads * head_dim

    def run(projected: mx.array, history: mx.array, state: mx.array, conv_w: mx.array,
            conv_b: mx.array, dt_bias: mx.array, a_log: mx.array, d: mx.array,
            norm_w: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        conv_dim = inner + 2 * groups * state_size
        gate, conv_in, dt = mx.split(projected, [inner, inner + conv_dim], axis=-1)
        padded = mx.concatenate([history, conv_in], axis=1)  # [B, kernel, C]
        conv = (padded * conv_w[:, :, 0].T.astype(padded.dtype)).sum(axis=1, keepdims=True)
        xs, b, c = mx.split(nn.silu(conv + conv_b.astype(conv.dtype)),
                            [inner, inner + groups * state_size], axis=-1)
        batch = xs.shape[0]
        xs = xs.reshape(batch, 1, heads, head_dim).astype(mx.float32)
        b = b.reshape(batch, 1, groups, state_size).astype(mx.float32)
        c = c.reshape(batch, 1, groups, state_size).astype(mx.float32)
        y, new_state = step(xs, time_steps(dt, dt_bias, limit), a_log, b, c, state)
        y = (y + xs * d.astype(mx.float32)[:, None]).reshape(batch, 1, inner)
        gated = nn.silu(gate) * y.astype(gate.dtype)
        grouped = mx.unflatten(gated, -1, (groups, inner // groups))
        normed = mx.fast.rms_norm(grouped, None, eps).flatten(-2)
        return norm_w * normed, padded[:, 1:], new_state

    return run


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of the features, after gating with silu(gate) (Mamba2's norm)."""

    def __init__(self, dims: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size = group_size
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        x = nn.silu(gate) * x
        grouped = mx.unflatten(x, -1, (-1, self.group_size))
        normed = mx.fast.rms_norm(grouped, None, self.eps).flatten(-2)
        return self["weight"] * normed


class Mamba2Mixer(nn.Module):
    """The Mamba2 mixer as Nemotron-H lays out its tensors (in_proj, conv1d, A_log, D, dt_bias,
    norm, out_proj)."""

    def __init__(self, hidden: int, heads: int, head_dim: int, groups: int, state_size: int,
                 kernel: int, eps: float, time_step_limit: tuple[float, float],
                 proj_bias: bool = False, conv_bias: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.groups, self.state_size = groups, state_size
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.time_step_limit = time_step_limit
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + heads, bias=proj_bias)
        self.conv1d = CausalConv1d(self.conv_dim, kernel, bias=conv_bias)
        self.dt_bias = mx.ones((heads,))
        self.A_log = mx.zeros((heads,))
        self.D = mx.ones((heads,))
        self.norm = GatedRMSNorm(self.inner, self.inner // groups, eps)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)
        self._step = decode_step(heads, head_dim, groups, state_size, time_step_limit, eps)
        self._compiled_step = mx.compile(self._step)

    def step(self, x: mx.array, conv: mx.array, ssm: mx.array, compiled: bool = False
             ) -> tuple[mx.array, mx.array, mx.array]:
        """One token [batch, 1, hidden] from the conv history and SSM state: (output, new
        history, new state). Pure (no cache), so a model can trace it into its own decode graph;
        `compiled` runs the part between the projections as this layer's own compiled graph."""
        y, history, state = self._between(self.in_proj(x), conv, ssm, compiled)
        return self.out_proj(y), history, state

    def _between(self, projected: mx.array, conv: mx.array, ssm: mx.array, compiled: bool
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """One token's part between the projections (conv, recurrence, gated norm)."""
        conv_b = self["conv1d"].get("bias")
        run = self._compiled_step if compiled else self._step
        y, history, state = run(
            projected, conv, ssm, self["conv1d"]["weight"],
            conv_b if conv_b is not None else mx.zeros((self.conv_dim,)), self["dt_bias"],
            -mx.exp(self["A_log"].astype(mx.float32)), self["D"], self["norm"]["weight"])
        return y, history, state

    def _decode_token(self, x: mx.array, cache) -> mx.array:
        y, history, state = self.step(x, cache.conv, cache.ssm, compiled=True)
        cache.update(history, state, 1)
        return y

    def _stepwise(self, x: mx.array, cache) -> mx.array:
        """A few tokens' recurrence one at a time, as decode runs it (the projections over all
        of them at once), every intermediate state handed to the cache (`keep_steps`: a
        speculative verify pass, which may be partly taken back)."""
        batch = x.shape[0]
        conv, ssm = cache.conv, cache.ssm
        if conv is None or ssm is None:
            conv = mx.zeros((batch, self.conv1d.kernel - 1, self.conv_dim), x.dtype)
            ssm = mx.zeros((batch, self.heads, self.head_dim, self.state_size), mx.float32)
        projected = self.in_proj(x)
        states, outputs = [(conv, ssm)], []
        for t in range(x.shape[1]):
            y, conv, ssm = self._between(projected[:, t:t + 1], conv, ssm, compiled=True)
            outputs.append(y)
            states.append((conv, ssm))
        cache.record(states)
        return self.out_proj(mx.concatenate(outputs, axis=1))

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        batch, length, _ = x.shape
        if cache is not None and getattr(cache, "keep_steps", False):
            return self._stepwise(x, cache)
        if length == 1 and cache is not None and cache.ssm is not None:
            return self._decode_token(x, cache)
        gate, conv_in, dt = mx.split(self.in_proj(x), [self.inner, self.inner + self.conv_dim],
                                     axis=-1)
        conv_out, history = self.conv1d(conv_in, cache.conv if cache is not None else None)
        xs, b, c = mx.split(nn.silu(conv_out),
                            [self.inner, self.inner + self.groups * self.state_size], axis=-1)
        xs = xs.reshape(batch, length, self.heads, self.head_dim).astype(mx.float32)
        b = b.reshape(batch, length, self.groups, self.state_size).astype(mx.float32)
        c = c.reshape(batch, length, self.groups, self.state_size).astype(mx.float32)
        dt = time_steps(dt, self["dt_bias"], self.time_step_limit)
        log_a = -mx.exp(self["A_log"].astype(mx.float32))
        state = cache.ssm if cache is not None else None
        run = step if length == 1 else scan
        y, state = run(xs, dt, log_a, b, c, state)
        y = y + xs * self["D"].astype(mx.float32)[:, None]
        if cache is not None:
            cache.update(history, state, length)
        y = y.reshape(batch, length, self.inner).astype(x.dtype)
        return self.out_proj(self.norm(y, gate))
