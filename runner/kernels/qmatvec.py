"""The fused kernels (`qmatvec.c`), compiled on first use, called by ctypes: dequantize-and-multiply
for affine quantized weights, and a bf16 matrix product that widens each weight as it reads it.

MLX's CPU `quantized_matmul` runs at a fraction of a GFLOP/s, and expanding weights to float32
for BLAS costs 8x an int4 model's size in memory. This kernel reads the packed weights as they
are and runs at the speed of reading them. `build.library` compiles it once per source, flags and
CPU (`cc -O3 -march=native`); without a compiler `available()` is False and the runner uses
another compute path. The bf16 product exists for the same reason: decode reads every weight once
per token, and a float32 copy for BLAS reads (and holds) twice the bytes of the stored bf16.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from runner.kernels import build
from runner.kernels.build import KernelUnavailable

SOURCE = Path(__file__).with_name("qmatvec.c")
BITS = (2, 4, 8)
_c_int64, _ptr = ctypes.c_int64, ctypes.c_void_p
__all__ = ["KernelUnavailable", "available", "matmul_bf16", "qmatmul", "supports"]


def supports(bits: int, group_size: int, mode: str, in_dims: int) -> bool:
    """Whether the kernel computes this layer (else it takes another path)."""
    return (mode == "affine" and bits in BITS and group_size % 16 == 0
            and in_dims % group_size == 0)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = build.library(SOURCE)
    fn = lib.qmatmul_affine
    fn.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _ptr, _ptr, ctypes.c_int, _c_int64,
                   ctypes.c_int, ctypes.c_int, _ptr]
    fn.restype = ctypes.c_int
    dense = lib.matmul_bf16
    dense.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _ptr]
    dense.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the kernel is built (building it now if needed) and loads."""
    return build.loads(_library)


def _check(w: np.ndarray, in_dims: int, bits: int, group_size: int) -> None:
    if not supports(bits, group_size, "affine", in_dims) or w.shape[1] * 32 != in_dims * bits:
        raise ValueError(f"unsupported layer: {bits}-bit, group {group_size}, in {in_dims}")


def qmatmul(x: np.ndarray, w: np.ndarray, scales: np.ndarray, biases: np.ndarray,
            bits: int, group_size: int) -> np.ndarray:
    """x[rows, in] (float32) . dequant(w)^T -> [rows, out] float32.

    `w` is uint32 [out, in * bits / 32]; `scales` and `biases` are float32, or bf16 viewed as
    uint16, [out, in / group_size]. All must be C-contiguous; the caller keeps them alive.
    """
    rows, in_dims = x.shape
    out_dims = w.shape[0]
    bf16 = scales.dtype == np.uint16
    _check(w, in_dims, bits, group_size)
    y = np.empty((rows, out_dims), dtype=np.float32)
    status = _library().qmatmul_affine(
        x.ctypes.data, rows, in_dims, w.ctypes.data, scales.ctypes.data, biases.ctypes.data,
        int(bf16), out_dims, bits, group_size, y.ctypes.data)
    if status != 0:
        raise ValueError(f"qmatmul_affine refused a {bits}-bit, group {group_size} layer")
    return y



def matmul_bf16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x[rows, in] (float32) . w^T -> [rows, out] float32, for bf16 weights `w` [out, in] viewed
    as uint16. Both C-contiguous; the caller keeps them alive."""
    rows, in_dims = x.shape
    out_dims = w.shape[0]
    if w.dtype != np.uint16 or w.ndim != 2 or w.shape[1] != in_dims or x.dtype != np.float32:
        raise ValueError(f"matmul_bf16: x {x.dtype}{x.shape} does not fit w {w.dtype}{w.shape}")
    y = np.empty((rows, out_dims), dtype=np.float32)
    if _library().matmul_bf16(x.ctypes.data, rows, in_dims, w.ctypes.data, out_dims,
                              y.ctypes.data) != 0:
        raise ValueError(f"matmul_bf16 refused a {out_dims}x{in_dims} layer")
    return y
