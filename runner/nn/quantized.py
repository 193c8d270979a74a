"""Per-group biases for quantized layers: stored, or derived from the scales.

A symmetric affine layer (GGUF's Q4_0, Q8_0, Q6_K: `QuantType.zero_point`) holds no biases:
each is -zero_point * scale, exactly (a power of two times the scale), made per call. For the
small fixture's Q4_0 GGUF that is 6 MiB of float16 the runner no longer holds; a call costs one
layer's biases for as long as its matmul runs, bitwise the weights stored biases would give.
Where the activations are wider than the scales (float32 on a CPU's native path), MLX's
quantized matmul casts scales and biases to the activations' type on every call anyway: the
scales are cast first and the biases derived in that type, which costs no more CPU than
stored biases (measured on the small fixture's layers; deriving them in float16 and letting
MLX cast both took ~12% longer a matmul).
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


def matmul_parts(layer: nn.Module, x: mx.array) -> tuple[mx.array, mx.array | None]:
    """The scales and biases to multiply `x` with: as held, or for a symmetric layer the
    scales in `x`'s wider float type (the cast MLX would make) and the biases derived there."""
    scales = layer["scales"]
    if "biases" in layer or getattr(layer, "zero_point", None) is None:
        return scales, layer.get("biases")
    if (mx.issubdtype(x.dtype, mx.floating) and x.dtype != scales.dtype
            and x.dtype.size > scales.dtype.size):
        scales = scales.astype(x.dtype)
    return scales, scales * -layer.zero_point


def quantized_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """x @ dequantize(layer's weight).T, its biases derived where not stored."""
    scales, biases = matmul_parts(layer, x)
    return mx.quantized_matmul(x, layer["weight"], scales, biases, transpose=True,
                               group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
