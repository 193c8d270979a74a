"""`runner.quant.quantize` of the fp modes on a CPU device does its per-weight work in C and
writes MLX's bytes; what the fast paths cannot match, MLX does; a fast path that disagrees with
the installed MLX on its probe is switched off, with a warning."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

from runner import quant_cpu
from runner.kernels import cpu_quantize
from runner.quant import QUANT_TYPES, quantize

pytestmark = pytest.mark.skipif(not cpu_quantize.usable(),
                                reason="no C compiler or not a CPU device: MLX quantizes")
DTYPES = [mx.bfloat16, mx.float16, mx.float32]


def _tensor(dtype, seed: int, extremes: bool = False):
    """Noise over 50 binary orders of magnitude (all finite in float16), a few special rows,
    and with `extremes` infinities, NaNs and subnormals (the fast path leaves those to MLX)."""
    keys = mx.random.split(mx.random.key(seed), 50)
    rows = [mx.zeros(64), mx.full(64, -2.0), mx.arange(64) / 3, mx.full(64, 1e-7)]
    rows += [mx.random.uniform(shape=(64,), key=keys[k]) * 2.0 ** (k - 36) - 2.0 ** (k - 37)
             for k in range(50)]
    if extremes:
        rows += [mx.full(64, float("inf")), mx.full(64, float("nan")), mx.full(64, 3e-39)]
    return mx.stack(rows).astype(dtype)


FP_MODES = ["nvfp4", "mxfp4", "mxfp8"]


def _same(got: dict, expected) -> bool:
    return all(np.array_equal(np.array(got[part]), np.array(theirs))
               for part, theirs in zip(("weight", "scale"), expected, strict=True))


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp_quantize_writes_mlx_bytes_through_the_kernel(monkeypatch, mode, dtype):
    qtype = QUANT_TYPES[mode]
    assert quant_cpu.fast_path(mode, qtype.bits, qtype.group_size, quant_cpu.dtype_tag(dtype))
    calls = []  # (its one probe ran just now)
    real = cpu_quantize.scaled_codes
    monkeypatch.setattr(cpu_quantize, "scaled_codes",
                        lambda *args: calls.append(1) or real(*args))
    for seed in range(3):
        weight = _tensor(dtype, seed)
        got = quantize(weight, qtype)
        expected = mx.quantize(weight, group_size=qtype.group_size, bits=qtype.bits, mode=mode)
        assert _same(got, expected), (mode, dtype, seed)
    assert len(calls) == 3  # the kernel coded every tensor


@pytest.mark.parametrize("mode", FP_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_nans_and_subnormals_still_give_mlx_bytes(mode, dtype):
    qtype = QUANT_TYPES[mode]
    weight = _tensor(dtype, 7, extremes=True)
    expected = mx.quantize(weight, group_size=qtype.group_size, bits=qtype.bits, mode=mode)
    assert _same(quantize(weight, qtype), expected)
    assert quant_cpu.fp_quantize(weight, mode, qtype.group_size) is None  # left to MLX whole


def test_a_fast_path_that_disagrees_with_mlx_is_switched_off(monkeypatch, caplog):
    qtype = QUANT_TYPES["nvfp4"]
    monkeypatch.setattr(quant_cpu, "_agrees", quant_cpu._agrees.__wrapped__)  # no cache
    real = cpu_quantize.scaled_codes
    monkeypatch.setattr(cpu_quantize, "scaled_codes", lambda *args: real(*args) ^ np.uint32(1))
    with caplog.at_level(logging.WARNING, logger="runner.quant_cpu"):
        assert not quant_cpu.fast_path("nvfp4", 4, 16, "BF16")
    assert "disagrees" in caplog.text and "nvfp4" in caplog.text
    weight = _tensor(mx.bfloat16, 1)
    expected = mx.quantize(weight, group_size=16, bits=4, mode="nvfp4")
    assert _same(quantize(weight, qtype), expected)  # MLX did it
    monkeypatch.setattr(cpu_quantize, "scaled_codes", real)
    assert quant_cpu.fast_path("nvfp4", 4, 16, "BF16")
    assert not quant_cpu.fast_path("nvfp4", 4, 16, "I8")  # no kernel for it


def test_the_fp_steps_refuse_what_they_cannot_take():
    four_groups = memoryview(bytes(4 * 32 * 4))
    with pytest.raises(ValueError, match="whole groups"):
        cpu_quantize.group_absmax(four_groups[:100], "F32", 32)
    with pytest.raises(ValueError, match="I8"):
        cpu_quantize.group_absmax(four_groups, "I8", 32)
    with pytest.raises(ValueError, match="3 divisors for 4 groups"):
        cpu_quantize.scaled_codes(four_groups, "F32", 32, np.ones(3, np.float32), "mxfp4")
    with pytest.raises(ValueError, match="int4"):
        cpu_quantize.scaled_codes(four_groups, "F32", 32, np.ones(4, np.float32), "int4")
