"""Causal depthwise 1-D convolution that carries its last `kernel - 1` inputs across calls.

Mamba2 convolves each channel of the projected input over a short window (4 steps). Written as
`kernel` shifted multiply-adds rather than a grouped `mx.conv1d`: with a handful of taps this is
one fused elementwise graph on any backend, and the same code serves prefill and decode. The
weight keeps MLX's Conv1d layout `[channels, kernel, 1]` (checkpoints store `[channels, 1,
kernel]`; the architecture's `sanitize` moves the axis).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class CausalConv1d(nn.Module):
    def __init__(self, channels: int, kernel: int, bias: bool = True) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = mx.zeros((channels, kernel, 1))
        if bias:
            self.bias = mx.zeros((channels,))

    def __call__(self, x: mx.array, history: mx.array | None) -> tuple[mx.array, mx.array]:
        """x [batch, length, channels]; history: the previous `kernel - 1` inputs (None: zeros).
        Returns (output, the new history)."""
        batch, length, channels = x.shape
        if history is None:
            history = mx.zeros((batch, self.kernel - 1, channels), x.dtype)
        padded = mx.concatenate([history.astype(x.dtype), x], axis=1)
        taps = self["weight"][:, :, 0].astype(x.dtype)
        out = padded[:, 0:length] * taps[:, 0]
        for i in range(1, self.kernel):
            out = out + padded[:, i:i + length] * taps[:, i]
        if "bias" in self:
            out = out + self["bias"].astype(x.dtype)
        return out, padded[:, -(self.kernel - 1):]
