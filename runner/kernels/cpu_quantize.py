"""MLX's quantization on the CPU, byte-identical and many times faster (`cpu_quantize.c`):
MLX's own CPU quantize divides weight by weight in scalar code for affine types (0.6 GB/s of
bf16 per core) and expands every weight 16-fold for an argmin in the fp4 modes (0.03 GB/s).

Used only where MLX would quantize on the CPU (`usable`): on a GPU device MLX's own kernels
are the fast ones.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from runner.kernels import build
from runner.kernels.build import KernelUnavailable

if TYPE_CHECKING:
    import numpy as np

SOURCE = Path(__file__).with_name("cpu_quantize.c")
GROUP_SIZES = (32, 64, 128)
BITS = (2, 4, 8)
# safetensors dtype tag -> (the kernel's dtype code, numpy dtype of its scales and biases);
# numpy is imported on first use: `ferry create`'s CLI imports this module, and waits for it.
DTYPES = {"F32": (0, "float32"), "BF16": (1, "uint16"), "F16": (2, "uint16")}
_ptr = ctypes.c_void_p
__all__ = ["KernelUnavailable", "affine", "affine_supports", "available", "fp4_codes",
           "usable"]


def affine_supports(dtype: str, bits: int, group_size: int, mode: str, in_dims: int) -> bool:
    """Whether `affine` quantizes such a tensor (else MLX does)."""
    return (mode == "affine" and dtype in DTYPES and bits in BITS
            and group_size in GROUP_SIZES and in_dims % group_size == 0)


@functools.cache
def _library() -> ctypes.CDLL:
    return configured(build.library(SOURCE))


def configured(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of SOURCE) with its functions' signatures declared."""
    lib.affine_quantize.argtypes = [_ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                    ctypes.c_int, _ptr, _ptr, _ptr]
    lib.affine_quantize.restype = ctypes.c_int
    lib.fp4_codes.argtypes = [_ptr, ctypes.c_int, ctypes.c_int64, _ptr]
    lib.fp4_codes.restype = ctypes.c_int
    return lib


@functools.cache
def available() -> bool:
    """True when the kernel is built (building it now if needed) and loads."""
    return build.loads(_library)


def usable() -> bool:
    """Whether quantizing should go through this kernel: MLX's device is the CPU, and the
    kernel builds here."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu and available()


def affine(source: memoryview, dtype: str, shape: tuple[int, ...], bits: int,
           group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed uint32, scales, biases) of the tensor whose raw bytes are `source`, shaped as
    `mx.quantize` returns them: [..., in * bits / 32], [..., in / group_size] twice. Scales
    and biases are in the source dtype (bf16 and f16 as uint16 bit patterns)."""
    import numpy as np

    in_dims = shape[-1] if shape else 0
    if not shape or not affine_supports(dtype, bits, group_size, "affine", in_dims):
        raise ValueError(f"affine quantize: {dtype}{list(shape)} at {bits} bits, group "
                         f"{group_size} is not supported")
    code, param_dtype = DTYPES[dtype]
    count = int(np.prod(shape))
    if source.nbytes != count * np.dtype(param_dtype).itemsize:
        raise ValueError(f"affine quantize: {source.nbytes} bytes do not hold "
                         f"{dtype}{list(shape)}")
    packed = np.empty((*shape[:-1], in_dims * bits // 32), dtype=np.uint32)
    scales = np.empty((*shape[:-1], in_dims // group_size), dtype=param_dtype)
    biases = np.empty_like(scales)
    data = np.frombuffer(source, dtype=np.uint8)
    status = _library().affine_quantize(data.ctypes.data, code, count // group_size,
                                        group_size, bits, packed.ctypes.data,
                                        scales.ctypes.data, biases.ctypes.data)
    del data  # before any raise: a traceback holding it would keep the caller's mapping open
    if status != 0:
        raise ValueError(f"affine quantize refused {bits} bits, group {group_size}")
    return packed, scales, biases


def fp4_codes(values: memoryview, dtype: str) -> np.ndarray:
    """The e2m1 code of each scaled weight (what MLX's fp4 quantize takes as argmin |v - LUT|,
    with each difference rounded to `dtype` as MLX computes it), eight to a uint32 word,
    lowest first. `values`: the raw bytes of a count of values that is a multiple of 8."""
    import numpy as np

    if dtype not in DTYPES:
        raise ValueError(f"fp4 codes: dtype {dtype} is not supported")
    code, raw = DTYPES[dtype]
    count = values.nbytes // np.dtype(raw).itemsize
    if count % 8 or values.nbytes % np.dtype(raw).itemsize:
        raise ValueError(f"fp4 codes: {values.nbytes} bytes are not a multiple of 8 {dtype}")
    out = np.empty(count // 8, dtype=np.uint32)
    data = np.frombuffer(values, dtype=np.uint8)
    if _library().fp4_codes(data.ctypes.data, code, count, out.ctypes.data) != 0:
        raise ValueError(f"fp4 codes refused {count} {dtype} values")
    return out
