"""MLX's affine quantization on the CPU, byte-identical and several times faster
(`affine_quantize.c`), for create: MLX's own CPU quantize runs a scalar division per weight.

Only where MLX would quantize on the CPU: on a GPU device MLX's own kernel is the fast one.
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

SOURCE = Path(__file__).with_name("affine_quantize.c")
GROUP_SIZES = (32, 64, 128)
BITS = (2, 4, 8)
# safetensors dtype tag -> (the kernel's dtype code, numpy dtype of its scales and biases);
# numpy is imported on first use: `ferry create`'s CLI imports this module, and waits for it.
DTYPES = {"F32": (0, "float32"), "BF16": (1, "uint16"), "F16": (2, "uint16")}
_ptr = ctypes.c_void_p
__all__ = ["KernelUnavailable", "available", "quantize", "supports"]


def supports(dtype: str, bits: int, group_size: int, mode: str, in_dims: int) -> bool:
    """Whether this kernel quantizes such a tensor (else MLX does)."""
    return (mode == "affine" and dtype in DTYPES and bits in BITS
            and group_size in GROUP_SIZES and in_dims % group_size == 0)


@functools.cache
def _library() -> ctypes.CDLL:
    return configured(build.library(SOURCE))


def configured(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of SOURCE) with its function's signature declared."""
    fn = lib.affine_quantize
    fn.argtypes = [_ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, _ptr, _ptr,
                   _ptr]
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the kernel is built (building it now if needed) and loads."""
    try:
        _library()
    except KernelUnavailable:
        return False
    return True


def quantize(source: memoryview, dtype: str, shape: tuple[int, ...], bits: int,
             group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed uint32, scales, biases) of the tensor whose raw bytes are `source`, shaped as
    `mx.quantize` returns them: [..., in * bits / 32], [..., in / group_size] twice. Scales
    and biases are in the source dtype (bf16 and f16 as uint16 bit patterns)."""
    import numpy as np

    in_dims = shape[-1] if shape else 0
    if not shape or not supports(dtype, bits, group_size, "affine", in_dims):
        raise ValueError(f"affine_quantize: {dtype}{list(shape)} at {bits} bits, group "
                         f"{group_size} is not supported")
    code, param_dtype = DTYPES[dtype]
    count = int(np.prod(shape))
    if source.nbytes != count * np.dtype(param_dtype).itemsize:
        raise ValueError(f"affine_quantize: {source.nbytes} bytes do not hold "
                         f"{dtype}{list(shape)}")
    groups = count // group_size
    packed = np.empty((*shape[:-1], in_dims * bits // 32), dtype=np.uint32)
    scales = np.empty((*shape[:-1], in_dims // group_size), dtype=param_dtype)
    biases = np.empty_like(scales)
    data = np.frombuffer(source, dtype=np.uint8)
    status = _library().affine_quantize(data.ctypes.data, code, groups, group_size, bits,
                                        packed.ctypes.data, scales.ctypes.data,
                                        biases.ctypes.data)
    if status != 0:
        raise ValueError(f"affine_quantize refused {bits} bits, group {group_size}")
    return packed, scales, biases
