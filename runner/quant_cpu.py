"""Fast stand-ins for `mx.quantize` on a CPU device, used only where they write its bytes.

MLX's CPU quantize is scalar for the affine modes (0.6 GB/s of bf16 per core) and, for nvfp4 and
mxfp4, an argmin over a 16-fold expansion of every weight (0.03 GB/s, 64 bytes of memory per
weight). `runner.kernels.cpu_quantize` does the affine modes whole and the fp4 modes' last step;
the fp4 scales and scaled weights stay MLX ops here. Each combination of mode, bits, group size
and source dtype is checked once per process against the installed MLX's own `mx.quantize` on a
probe with awkward groups (zeros, constants, ramps, tiny and huge ranges); where any byte
differs, `mx.quantize` does that work instead and a warning says so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from runner.kernels import cpu_quantize

log = logging.getLogger(__name__)
FP4_MODES = ("nvfp4", "mxfp4")
_F32_MIN_NORMAL = 2.0 ** -126


def fast_path(mode: str, bits: int, group_size: int, dtype: str) -> bool:
    """Whether tensors of safetensors `dtype` quantize through the kernel (CPU device, the
    kernel builds, and its bytes matched MLX's on the probe)."""
    supported = (cpu_quantize.affine_supports(dtype, bits, group_size, mode, group_size)
                 if mode == "affine" else mode in FP4_MODES and dtype in cpu_quantize.DTYPES)
    return supported and cpu_quantize.usable() and _agrees(mode, bits, group_size, dtype)


def dtype_tag(dtype: Any) -> str:
    """The safetensors tag of an MLX float dtype ("" for any other)."""
    import mlx.core as mx

    return {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}.get(dtype, "")


def fp4_quantize(weight: Any, mode: str, group_size: int) -> tuple[Any, Any] | None:
    """(packed codes, scales) as `mx.quantize(weight, mode=mode)` gives them, or None where
    this tensor is left to MLX: a group whose scale is not finite or is subnormal (there MLX's
    arithmetic is its own)."""
    import mlx.core as mx

    shape = weight.shape
    wq = weight.reshape(-1, group_size)
    scales = mx.divide(mx.max(mx.abs(wq), -1, keepdims=True), mx.array(6.0, weight.dtype))
    if mode == "nvfp4":  # e4m3 scales: MLX's CPU ops, in its order and dtypes
        encode = mx.array(1.0, mx.float32)
        scales = mx.to_fp8(mx.multiply(scales, encode))
        wq = mx.multiply(mx.divide(wq, mx.from_fp8(scales, weight.dtype)), encode)
    else:  # mxfp4: e8m0 scales, the exponent of amax / 6 rounded up
        wide = scales.astype(mx.float32)
        odd = mx.logical_or(mx.logical_not(mx.isfinite(wide)),
                            mx.logical_and(wide > 0, wide < _F32_MIN_NORMAL))
        if mx.any(odd).item():
            return None
        exponents = mx.where(wide == 0, mx.array(0.0), mx.ceil(mx.log2(wide)))
        wq = mx.divide(wq, mx.power(mx.array(2.0, weight.dtype), exponents.astype(weight.dtype)))
        scales = mx.add(exponents, mx.array(127.0)).astype(mx.uint8)
    mx.eval(wq, scales)
    tag = dtype_tag(wq.dtype)
    raw = wq if tag == "F32" else wq.view(mx.uint16)  # buffers have no bf16 format
    codes = cpu_quantize.fp4_codes(memoryview(raw).cast("B"), tag)  # type: ignore[arg-type]
    del wq, raw
    return mx.array(codes).reshape(*shape[:-1], -1), scales.reshape(*shape[:-1], -1)


def _probe(dtype: Any, width: int) -> Any:
    """Rows that reach every branch of the quantizers, plus noise at many scales."""
    import mlx.core as mx

    key = mx.random.key(0)
    noise = mx.random.normal((24, width), key=key)
    rows = [mx.zeros(width), mx.full(width, -1.5), mx.full(width, 1e-3), mx.arange(width) / 7,
            -mx.abs(noise[0]), mx.abs(noise[1]) * 1000, noise[2] * 1e-6,
            mx.array([1.0, -1.0] * (width // 2))]
    rows += [noise[3 + i] * 2.0 ** (i - 10) for i in range(21)]
    return mx.stack(rows).astype(dtype)


@functools.cache
def _agrees(mode: str, bits: int, group_size: int, dtype: str) -> bool:
    import mlx.core as mx
    import numpy as np

    mx_dtype = next(d for d in (mx.float32, mx.bfloat16, mx.float16) if dtype_tag(d) == dtype)
    weight = _probe(mx_dtype, 4 * group_size)
    expected = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
    mx.eval(*expected)
    if mode == "affine":
        raw = weight if dtype == "F32" else weight.view(mx.uint16)
        mx.eval(raw)
        got: Any = cpu_quantize.affine(memoryview(raw).cast("B"), dtype, tuple(weight.shape),
                                       bits, group_size)
    else:
        got = fp4_quantize(weight, mode, group_size)
    same = got is not None and all(
        np.array_equal(np.asarray(mine).view(np.uint8),
                       np.array(theirs.view(mx.uint8) if theirs.dtype != mx.uint8
                                else theirs))
        for mine, theirs in zip(got, expected, strict=True))
    if not same:
        log.warning("the CPU quantize kernel disagrees with this MLX's mx.quantize for %s "
                    "(%d bits, group %d, %s); quantizing with MLX instead", mode, bits,
                    group_size, dtype)
    return same
