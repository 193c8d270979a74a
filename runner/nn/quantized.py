"""Per-group biases for quantized layers: stored, or derived from the scales.

A symmetric affine layer (GGUF's Q4_0, Q8_0, Q6_K: `QuantType.zero_point`) holds no biases:
each is -zero_point * scale, exactly (a power of two times the scale), made per call in the
scales' dtype. For the small fixture's Q4_0 GGUF that is 6 MiB of float16 the runner no longer
holds; a call costs one layer's biases for as long as its matmul runs (bitwise the same
weights as stored biases would give).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def group_biases(layer: nn.Module, rows: mx.array | None = None) -> mx.array | None:
    """The layer's per-group biases (of `rows` only, when given): stored, derived from its
    scales when it is symmetric affine, else None (the fp modes have none)."""
    biases = layer.get("biases")
    if biases is not None:
        return biases if rows is None else biases[rows]
    if getattr(layer, "zero_point", None) is None:
        return None
    scales = layer["scales"] if rows is None else layer["scales"][rows]
    return scales * -layer.zero_point


def quantized_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ dequantize(layer's weight).T, its biases derived where not stored."""
    return mx.quantized_matmul(x, layer["weight"], layer["scales"], group_biases(layer),
                               transpose=True, group_size=layer.group_size, bits=layer.bits,
                               mode=layer.mode)
