"""MLX's quantization on the CPU, byte-identical and many times faster (`cpu_quantize.c`):
MLX's own CPU quantize divides weight by weight in scalar code for affine types (0.6 GB/s of
bf16 per core), runs the fp modes as composed ops, and for fp4 expands every weight 16-fold for
an argmin (0.03 GB/s).

Used only where MLX would quantize on the CPU (`usable`): on a GPU device MLX's own kernels
are the fast ones.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
# scaled_codes' kinds: fp4 with differences in the source dtype (mxfp4) or in float32 (nvfp4),
# and e4m3 bytes (mxfp8)
CODE_KINDS = {"mxfp4": 0, "nvfp4": 1, "mxfp8": 2}
__all__ = ["CODE_KINDS", "KernelUnavailable", "affine", "affine_supports", "available",
           "group_absmax", "scaled_codes", "usable"]


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
    lib.group_absmax.argtypes = [_ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _ptr]
    lib.group_absmax.restype = ctypes.c_int
    lib.scaled_codes.argtypes = [_ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _ptr,
                                 ctypes.c_int, _ptr]
    lib.scaled_codes.restype = ctypes.c_int
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
    if source.nbytes != int(np.prod(shape)) * np.dtype(DTYPES[dtype][1]).itemsize:
        raise ValueError(f"affine quantize: {source.nbytes} bytes do not hold "
                         f"{dtype}{list(shape)}")
    code, data, count = _values(source, dtype, group_size)
    packed = np.empty((*shape[:-1], in_dims * bits // 32), dtype=np.uint32)
    scales = np.empty((*shape[:-1], in_dims // group_size), dtype=DTYPES[dtype][1])
    biases = np.empty_like(scales)
    status = _library().affine_quantize(data.ctypes.data, code, count // group_size,
                                        group_size, bits, packed.ctypes.data,
                                        scales.ctypes.data, biases.ctypes.data)
    del data  # before any raise: a traceback holding it would keep the caller's mapping open
    if status != 0:
        raise ValueError(f"affine quantize refused {bits} bits, group {group_size}")
    return packed, scales, biases


def group_absmax(source: memoryview, dtype: str, group_size: int) -> np.ndarray:
    """max |w| of each group of `group_size` values (float32; NaN where a group has one)."""
    import numpy as np

    code, data, count = _values(source, dtype, group_size)
    out = np.empty(count // group_size, dtype=np.float32)
    status = _library().group_absmax(data.ctypes.data, code, out.size, group_size,
                                     out.ctypes.data)
    del data
    if status != 0:
        raise ValueError(f"group absmax refused group {group_size}")
    return out


def scaled_codes(source: memoryview, dtype: str, group_size: int, divisors: np.ndarray,
                 mode: str) -> np.ndarray:
    """The fp mode's packed weights (uint32, [values * bits / 32]): each value divided by its
    group's divisor (float32, one per group: what MLX divides by, in the source dtype) as MLX
    divides, then coded as `mode` codes it (e2m1 nibbles, or e4m3 bytes for mxfp8)."""
    import numpy as np

    code, data, count = _values(source, dtype, group_size)
    groups = count // group_size
    divisors = np.ascontiguousarray(divisors, dtype=np.float32)
    if divisors.size != groups or mode not in CODE_KINDS or group_size % 8:
        raise ValueError(f"scaled codes: {mode}, {divisors.size} divisors for {groups} groups "
                         f"of {group_size}")
    out = np.empty(count // 4 if mode == "mxfp8" else count // 8, dtype=np.uint32)
    status = _library().scaled_codes(data.ctypes.data, code, groups, group_size,
                                     divisors.ctypes.data, CODE_KINDS[mode], out.ctypes.data)
    del data
    if status != 0:
        raise ValueError(f"scaled codes refused {mode}, group {group_size}")
    return out


def _values(source: memoryview, dtype: str, group_size: int) -> tuple[int, Any, int]:
    """(the kernel's dtype code, the source as a numpy byte view, its count of values), once
    `source` is known to hold whole groups of `dtype` values."""
    import numpy as np

    if dtype not in DTYPES:
        raise ValueError(f"quantize: dtype {dtype} is not supported")
    code, raw = DTYPES[dtype]
    itemsize = np.dtype(raw).itemsize
    if source.nbytes % (itemsize * group_size):
        raise ValueError(f"quantize: {source.nbytes} bytes are not whole groups of "
                         f"{group_size} {dtype}")
    return code, np.frombuffer(source, dtype=np.uint8), source.nbytes // itemsize
