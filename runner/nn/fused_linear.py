"""Quantized linear layers for the "fused" compute path: weights stay packed in memory.

Decode (a few rows of x) goes through the fused dequantize-and-multiply kernel
(`runner/kernels/qmatvec.c`), which reads 4 or 8 bits per weight instead of 32 and so beats a
float32 GEMV while the model keeps its quantized size. Prefill (many rows) is compute-bound:
there the layer dequantizes a block of rows at a time to float32 and hands it to BLAS, so the
full float32 matrix never exists. The layer evaluates its input (the kernel is not an MLX op):
it is a graph boundary, which costs a little pipelining and nothing in results.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.kernels import qmatvec
from runner.quant import QuantType

DECODE_ROWS = 4  # at most this many rows of x use the kernel; more are dequantized for BLAS
BLOCK_BYTES = 16 * 1024 * 1024  # float32 rows dequantized at once during prefill


@dataclass
class _Packed:
    """NumPy views of the layer's MLX buffers (no copies), made once on first use."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray


def _host(array: mx.array) -> np.ndarray:
    """A zero-copy NumPy view (bf16 as uint16, which NumPy lacks)."""
    flat = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    return np.asarray(memoryview(flat))  # type: ignore[arg-type]  # MLX arrays are buffers


def fused_supported(qtype: QuantType, input_dims: int) -> bool:
    return qmatvec.supports(qtype.bits, qtype.group_size, qtype.mode, input_dims)


class FusedQuantizedLinear(nn.Module):
    """y = x dequant(W)^T (+ b) for affine 2/4/8-bit weights, held packed as create stored them.

    Same parameters as `QuantizedLinear` (packed `weight`, `scales`, `biases`), so the same blobs
    load into it; scales stay in their stored dtype (bf16 or float32; others become float32).
    """

    def __init__(self, input_dims: int, output_dims: int, qtype: QuantType,
                 bias: bool = False) -> None:
        super().__init__()
        self.group_size = qtype.group_size
        self.bits = qtype.bits
        self.input_dims, self.output_dims = input_dims, output_dims
        self.weight = mx.zeros((output_dims, input_dims * qtype.bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // qtype.group_size))
        self.biases = mx.zeros((output_dims, input_dims // qtype.group_size))
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.packed: _Packed | None = None

    def _packed(self) -> _Packed:
        if self.packed is None:
            scales, biases = self["scales"], self["biases"]
            if scales.dtype not in (mx.bfloat16, mx.float32) or biases.dtype != scales.dtype:
                scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
                self.scales, self.biases = scales, biases
            mx.eval(self["weight"], scales, biases)
            self.packed = _Packed(_host(self["weight"]), _host(scales), _host(biases))
        return self.packed

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        x32 = x.reshape(-1, self.input_dims).astype(mx.float32)
        mx.eval(x32)
        host = np.ascontiguousarray(_host(x32))
        rows = host.shape[0]
        y = self._decode(host) if rows <= DECODE_ROWS else self._prefill(host)
        out = mx.array(y).reshape(*lead, self.output_dims)
        return out + self["bias"] if "bias" in self else out

    def _decode(self, x: np.ndarray) -> np.ndarray:
        p = self._packed()
        return qmatvec.qmatmul(x, p.weight, p.scales, p.biases, self.bits, self.group_size)

    def _prefill(self, x: np.ndarray) -> np.ndarray:
        p = self._packed()
        y = np.empty((x.shape[0], self.output_dims), dtype=np.float32)
        block = max(1, BLOCK_BYTES // (4 * self.input_dims))
        for start in range(0, self.output_dims, block):
            rows = slice(start, min(start + block, self.output_dims))
            w = qmatvec.dequantize(p.weight, p.scales, p.biases, self.bits, self.group_size,
                                   rows)
            np.matmul(x, w.T, out=y[:, rows])
        return y
