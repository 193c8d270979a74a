"""Rotary position embeddings: plain, linear-scaled and Llama 3 frequency scaling.

Llama 3 checkpoints carry `rope_scaling = {"rope_type": "llama3", "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}`: long wavelengths are stretched by
`factor`, short ones kept, and the band between interpolated smoothly. The frequencies are
computed once here and handed to `mx.fast.rope`, so the per-token cost is the same as plain RoPE.
GGUF files carry the same scaling precomputed as a `rope_freqs` tensor of per-pair factors
(runner/gguf_load.py passes them on as `{"rope_type": "freq_factors", "factors": [...]}`).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn


def llama3_frequencies(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """The per-pair inverse-rate array `mx.fast.rope(freqs=)` expects, Llama 3 scaled."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_context / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(medium, smoothed, freqs)


class RoPE(nn.Module):
    """Rotary embedding over the first `dims` features of the last axis (non-interleaved)."""

    def __init__(self, dims: int, base: float, scaling: dict[str, Any] | None = None,
                 traditional: bool = False) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base: float | None = base
        self.scale = 1.0
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if kind == "llama3":
            self._freqs = llama3_frequencies(dims, base, scaling or {})
            self.base = None
        elif kind == "freq_factors":  # a GGUF's rope_freqs tensor: per-pair divisors
            factors = mx.array((scaling or {})["factors"], dtype=mx.float32)
            self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors
            self.base = None
        elif kind == "linear":
            self.scale = 1.0 / float((scaling or {})["factor"])
        elif kind != "default":
            raise ValueError(f"unsupported rope_scaling type {kind!r}")

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        freqs = getattr(self, "_freqs", None)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset, freqs=freqs)
