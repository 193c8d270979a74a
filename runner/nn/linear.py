"""Linear layers: dense, and quantized in every create quant type (affine int4/int8, nvfp4,
mxfp4, mxfp8).

A quantized layer holds exactly what `mx.quantize` returned and create stored: the packed uint32
`weight`, `scales`, and for affine modes `biases` (the per-group offsets, not a layer bias;
derived from the scales, not held, for GGUF's symmetric types: runner/nn/quantized.py).
Its `group_size`, `bits` and `mode` come from the blob's metadata (`QuantType.from_metadata`), per
layer, because create promotes some tensors (lm_head, k/v/down for 4-bit) to the 8-bit type.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner.nn.quantized import quantized_matmul
from runner.quant import QuantType


class Linear(nn.Module):
    """y = x W^T (+ b), in whatever dtype the weight holds."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight"].T)
        return x @ self["weight"].T

    def to_quantized(self, qtype: QuantType) -> QuantizedLinear:
        out_dims, in_dims = self["weight"].shape
        return QuantizedLinear(in_dims, out_dims, qtype, bias="bias" in self)


class QuantizedLinear(nn.Module):
    """y = x dequant(W)^T (+ b) through `mx.quantized_matmul`, weights never expanded."""

    def __init__(self, input_dims: int, output_dims: int, qtype: QuantType,
                 bias: bool = False) -> None:
        super().__init__()
        self.group_size = qtype.group_size
        self.bits = qtype.bits
        self.mode = qtype.mode
        self.zero_point = qtype.zero_point  # symmetric: biases derived (runner/nn/quantized.py)
        self.weight = mx.zeros((output_dims, input_dims * qtype.bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // qtype.group_size))
        if qtype.stored_bias:
            self.biases = mx.zeros((output_dims, input_dims // qtype.group_size))
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(self, x)
        return y + self["bias"] if "bias" in self else y
