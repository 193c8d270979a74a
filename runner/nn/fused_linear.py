"""Linear layers for the "fused" compute path: weights stay packed (or bf16) in memory.

Decode (a few rows of x) goes through the fused dequantize-and-multiply kernel
(`runner/kernels/qmatvec.c`), which reads 4 or 8 bits per weight instead of 32 and so beats a
float32 GEMV while the model keeps its quantized size. The kernel is not an MLX op, so decode
evaluates its input there (a graph boundary: a little less pipelining, the same results).
Prefill (many rows) is compute-bound: there the layer dequantizes its matrix to float32 as a
transient inside the MLX graph and lets BLAS multiply, one layer at a time.

`FusedDenseLinear` does the same for a dense bf16 weight: the kernel widens each weight as it
reads it (exactly the float32 value), so decode reads half the bytes of a float32 copy and the
model keeps its stored size; prefill upcasts one layer at a time for BLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.kernels import qmatvec
from runner.quant import QuantType

DECODE_ROWS = 8  # up to this many rows (decode, speculative checks) use the kernel


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


def _rows(x: mx.array, input_dims: int) -> np.ndarray:
    """x as evaluated float32 rows [n, input_dims] on the host (the kernels' input)."""
    x32 = x.reshape(-1, input_dims).astype(mx.float32)
    mx.eval(x32)
    return np.ascontiguousarray(_host(x32))


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
        rows = x.size // self.input_dims
        y = self._decode(x) if rows <= DECODE_ROWS else self._prefill(x)
        return y + self["bias"] if "bias" in self else y

    def _decode(self, x: mx.array) -> mx.array:
        p = self._packed()
        y = qmatvec.qmatmul(_rows(x, self.input_dims), p.weight, p.scales, p.biases,
                            self.bits, self.group_size)
        return mx.array(y).reshape(*x.shape[:-1], self.output_dims)

    def _prefill(self, x: mx.array) -> mx.array:
        """Lazy in its own output, so a prefill whose logits nobody reads never computes the
        head; but its input is evaluated first, so the graph holds one layer's transient
        float32 matrices at a time rather than every layer's at once. Scales are widened first
        so each weight is exactly what the kernel and the float32 path use."""
        mx.eval(x)
        w = mx.dequantize(self["weight"], self["scales"].astype(mx.float32),
                          self["biases"].astype(mx.float32), group_size=self.group_size,
                          bits=self.bits)
        return x.astype(mx.float32) @ w.T


class FusedDenseLinear(nn.Module):
    """y = x W^T (+ b) for a bf16 weight held as stored: the bf16 kernel for decode, a transient
    float32 copy of this one layer for prefill's BLAS. Same parameters as `Linear`."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__()
        self.input_dims, self.output_dims = input_dims, output_dims
        self.weight = mx.zeros((output_dims, input_dims), dtype=mx.bfloat16)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.host: np.ndarray | None = None

    def _host_weight(self) -> np.ndarray:
        if self.host is None:
            weight = self["weight"]
            if weight.dtype != mx.bfloat16:
                raise ValueError(f"FusedDenseLinear holds bf16 weights, not {weight.dtype}")
            mx.eval(weight)
            self.host = _host(weight)
        return self.host

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // self.input_dims
        if rows <= DECODE_ROWS:
            y = mx.array(qmatvec.matmul_bf16(_rows(x, self.input_dims), self._host_weight()))
            y = y.reshape(*x.shape[:-1], self.output_dims)
        else:  # see FusedQuantizedLinear._prefill
            mx.eval(x)
            y = x.astype(mx.float32) @ self["weight"].astype(mx.float32).T
        return y + self["bias"] if "bias" in self else y
