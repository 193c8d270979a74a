"""The C affine quantizer writes exactly what `mx.quantize` writes: packed words, scales and
biases, bit for bit, for every source dtype, bit width and group size it takes; built without
AVX2, its plain loops (and the fp modes' steps) do too."""

from __future__ import annotations

import platform

import mlx.core as mx
import numpy as np
import pytest

from runner import quant_cpu
from runner.kernels import build, cpu_quantize

pytestmark = pytest.mark.skipif(not cpu_quantize.available(),
                                reason="no C compiler: create uses MLX's quantize")

TAGS = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32"}


def _awkward(shape: tuple[int, ...], dtype, seed: int):
    """Noise, plus rows that hit every branch: zeros, a constant, all negative, all positive,
    a ramp, huge and tiny magnitudes, a group whose min and max are equally far from zero."""
    mx.random.seed(seed)
    w = mx.random.normal(shape) * 0.05
    flat = w.reshape(-1, shape[-1])
    rows = flat.shape[0]
    specials = [mx.zeros(shape[-1]), mx.full(shape[-1], -1.5), -mx.abs(flat[0]),
                mx.abs(flat[0]) * 1000, mx.arange(shape[-1]) / 7, mx.full(shape[-1], 1e-3),
                flat[0] * 1e-6, mx.array([1.0, -1.0] * (shape[-1] // 2))]
    for i, row in enumerate(specials[:rows]):
        flat[i] = row
    return flat.reshape(shape).astype(dtype)


def _bits_of(array) -> np.ndarray:
    return np.array(array.view(mx.uint16) if array.dtype in (mx.bfloat16, mx.float16)
                    else array)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_the_kernel_writes_what_mlx_writes(dtype, bits, group_size):
    for seed, shape in enumerate([(16, 256), (1, 128), (3, 5, 384), (9, 640)]):
        w = _awkward(shape, dtype, seed)
        ref = mx.quantize(w, group_size=group_size, bits=bits)
        mx.eval(*ref)
        source = memoryview(_bits_of(w)).cast("B")
        packed, scales, biases = cpu_quantize.affine(source, TAGS[dtype], shape, bits,
                                                          group_size)
        assert packed.shape == tuple(ref[0].shape) and scales.shape == tuple(ref[1].shape)
        assert np.array_equal(packed, np.array(ref[0])), (shape, "packed")
        assert np.array_equal(scales, _bits_of(ref[1])), (shape, "scales")
        assert np.array_equal(biases, _bits_of(ref[2])), (shape, "biases")


def test_what_the_kernel_does_not_take_is_refused_by_name():
    data = memoryview(bytes(2 * 64 * 4))
    with pytest.raises(ValueError, match="3 bits"):
        cpu_quantize.affine(data, "F32", (2, 64), 3, 64)
    with pytest.raises(ValueError, match="group 48"):
        cpu_quantize.affine(data, "F32", (2, 64), 4, 48)
    with pytest.raises(ValueError, match="I8"):
        cpu_quantize.affine(data, "I8", (2, 64), 4, 64)
    with pytest.raises(ValueError, match="do not hold"):
        cpu_quantize.affine(data[:100], "F32", (2, 64), 4, 64)
    assert not cpu_quantize.affine_supports("BF16", 4, 64, "nvfp4", 64)
    assert not cpu_quantize.affine_supports("BF16", 4, 64, "affine", 96)


def test_the_portable_loops_write_what_mlx_writes_too(monkeypatch):
    """Built without AVX2 and F16C (as on a CPU that lacks them), the plain C loops run."""
    flags = ("-O2", "-march=x86-64", "-shared", "-fPIC", "-std=c11")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        flags = ("-O2", "-shared", "-fPIC", "-std=c11")
    portable = cpu_quantize.configured(build.library(cpu_quantize.SOURCE, flags))
    monkeypatch.setattr(cpu_quantize, "_library", lambda: portable)
    assert "AVX2" not in " ".join(flags) and flags != build.FLAGS
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for bits in (2, 4, 8):
            w = _awkward((12, 192), dtype, bits)
            ref = mx.quantize(w, group_size=64, bits=bits)
            mx.eval(*ref)
            got = cpu_quantize.affine(memoryview(_bits_of(w)).cast("B"), TAGS[dtype],
                                           (12, 192), bits, 64)
            for mine, theirs in zip(got, ref, strict=True):
                assert np.array_equal(mine, _bits_of(theirs)), (dtype, bits)
    for mode, group, bits in (("nvfp4", 16, 4), ("mxfp4", 32, 4), ("mxfp8", 32, 8)):
        for dtype in (mx.bfloat16, mx.float16, mx.float32):  # the fp steps' plain loops
            w = _awkward((12, 128), dtype, 3)
            expected = mx.quantize(w, group_size=group, bits=bits, mode=mode)
            got = quant_cpu.fp_quantize(w, mode, group)
            assert got is not None
            for mine, theirs in zip(got, expected, strict=True):
                assert np.array_equal(np.array(mine), np.array(theirs)), (mode, dtype)


def test_threads_asking_for_a_new_build_at_once_all_get_it():
    """create's two quantizing threads reach the first build together: one builds, both load
    (they used to share a temp name, and the second's rename failed)."""
    import threading
    import uuid

    flags = (*build.FLAGS, f"-DFERRY_TEST_NONCE={uuid.uuid4().int % 10**9}")  # a new library
    results: list[object] = []
    start = threading.Barrier(4)

    def ask() -> None:
        start.wait()
        try:
            results.append(build.library(cpu_quantize.SOURCE, flags))
        except Exception as exc:  # the test reports whatever went wrong
            results.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(not isinstance(r, Exception) for r in results), results
    path = build._library_path(cpu_quantize.SOURCE, flags)
    assert path.is_file() and not list(path.parent.glob(f".{path.name}.*"))
    path.unlink()


def test_a_failed_build_says_why_once_and_is_not_retried(monkeypatch, caplog):
    import logging
    import uuid

    flags = (*build.FLAGS, f"-DFERRY_TEST_NONCE={uuid.uuid4().int % 10**9}")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # no compiler here
    tries = []
    real = build._build
    monkeypatch.setattr(build, "_build", lambda *a: tries.append(1) or real(*a))
    with caplog.at_level(logging.WARNING, logger="runner.kernels.build"):
        for _ in range(3):
            with pytest.raises(build.KernelUnavailable, match="no C compiler"):
                build.library(cpu_quantize.SOURCE, flags)
    assert len(tries) == 1
    assert caplog.text.count("install a C compiler") == 1
