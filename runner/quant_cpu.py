"""Fast stand-ins for `mx.quantize` on a CPU device, used only where they write its bytes.

MLX's CPU quantize is scalar for the affine modes (0.6 GB/s of bf16 per core), composed ops for
the fp modes (0.37 GB/s for mxfp8) and, for nvfp4 and mxfp4, an argmin over a 16-fold expansion
of every weight (0.03 GB/s, 64 bytes of memory per weight). `runner.kernels.cpu_quantize` does
the affine modes whole and the fp modes' per-weight work (1.3 GB/s mxfp8, 0.65 GB/s fp4); their
per-group scales stay MLX ops. Each combination of mode, bits, group size and source dtype is
checked once per process against the installed MLX's own `mx.quantize` on a probe with awkward
groups (zeros, constants, ramps, tiny and huge ranges); where any byte differs, `mx.quantize`
does that work instead and a warning says so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from runner.kernels import cpu_quantize

log = logging.getLogger(__name__)
FP_MODES = ("nvfp4", "mxfp4", "mxfp8")
_F32_MIN_NORMAL = 2.0 ** -126


def fast_path(mode: str, bits: int, group_size: int, dtype: str) -> bool:
    """Whether tensors of safetensors `dtype` quantize through the kernel (CPU device, the
    kernel builds, and its bytes matched MLX's on the probe)."""
    supported = (cpu_quantize.affine_supports(dtype, bits, group_size, mode,
                                              in_dims=group_size)  # the caller checks its own
                 if mode == "affine" else mode in FP_MODES and dtype in cpu_quantize.DTYPES)
    return supported and cpu_quantize.usable() and _agrees(mode, bits, group_size, dtype)


def dtype_tag(dtype: Any) -> str:
    """The safetensors tag of an MLX float dtype ("" for any other)."""
    import mlx.core as mx

    return {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}.get(dtype, "")


def fp_quantize(weight: Any, mode: str, group_size: int) -> tuple[Any, Any] | None:
    """(packed weights, scales) as `mx.quantize(weight, mode=mode)` gives them for an fp mode,
    or None where this tensor is left to MLX: a NaN or infinity in it, or (mx modes) a group
    whose scale is subnormal, where MLX's arithmetic is its own.

    The kernel finds each group's max |w| and codes every weight; between the two, the per
    group scales and divisors are MLX's own ops on one value per group, in its order and dtypes
    (its CPU fallback's; the mx modes' exponent is amax / max rounded up, as MLX 0.32.4 does)."""
    import mlx.core as mx
    import numpy as np

    shape, tag = weight.shape, dtype_tag(weight.dtype)
    raw = weight if tag == "F32" else weight.view(mx.uint16)  # buffers have no bf16 format
    mx.eval(raw)
    source = memoryview(raw).cast("B")  # type: ignore[arg-type]
    amax = cpu_quantize.group_absmax(source, tag, group_size)
    if not np.isfinite(amax).all():
        return None
    top = mx.array(6.0 if mode != "mxfp8" else 448.0, weight.dtype)
    scales = mx.divide(mx.array(amax).astype(weight.dtype).reshape(-1, 1), top)
    if mode == "nvfp4":  # e4m3 scales
        scales = mx.to_fp8(mx.multiply(scales, mx.array(1.0, mx.float32)))
        divisors = mx.from_fp8(scales, weight.dtype)
    else:  # mxfp4, mxfp8: e8m0 scales
        wide = scales.astype(mx.float32)
        if mx.any(mx.logical_and(wide > 0, wide < _F32_MIN_NORMAL)).item():
            return None
        exponents = mx.where(wide == 0, mx.array(0.0), mx.ceil(mx.log2(wide)))
        divisors = mx.power(mx.array(2.0, weight.dtype), exponents.astype(weight.dtype))
        scales = mx.add(exponents, mx.array(127.0)).astype(mx.uint8)
    packed = cpu_quantize.scaled_codes(source, tag, group_size,
                                       np.array(divisors.astype(mx.float32)).reshape(-1), mode)
    del source, raw
    return mx.array(packed).reshape(*shape[:-1], -1), scales.reshape(*shape[:-1], -1)


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
        got = fp_quantize(weight, mode, group_size)
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
