"""The fused kernels (`qmatvec.c`), compiled on first use, called by ctypes: dequantize-and-multiply
for affine quantized weights, and a bf16 matrix product that widens each weight as it reads it.

MLX's CPU `quantized_matmul` runs at a fraction of a GFLOP/s, and expanding weights to float32
for BLAS costs 8x an int4 model's size in memory. This kernel reads the packed weights as they
are and runs at the speed of reading them. It is built once per source, compiler flags and CPU
into `runner/kernels/_build/` (or a private temp dir when the checkout is read-only) with
`cc -O3 -march=native`; without a compiler `available()` is False and the runner uses
another compute path. The bf16 product exists for the same reason: decode reads every weight once
per token, and a float32 copy for BLAS reads (and holds) twice the bytes of the stored bf16.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("qmatvec.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
BITS = (2, 4, 8)
_c_int64, _ptr = ctypes.c_int64, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def supports(bits: int, group_size: int, mode: str, in_dims: int) -> bool:
    """Whether the kernel computes this layer (else it takes another path)."""
    return (mode == "affine" and bits in BITS and group_size % 16 == 0
            and in_dims % group_size == 0)


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                         + _cpu_key().encode() + platform.machine().encode()).hexdigest()[:16]
    build = SOURCE.parent / "_build"
    try:
        build.mkdir(exist_ok=True)
        probe = build / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        build = Path(tempfile.mkdtemp(prefix="ferry-kernels-"))  # private, mode 0700
    return build / f"qmatvec-{key}.so"


def _build(target: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler found (install gcc)")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    result = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCE)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"building {SOURCE.name} failed: {result.stderr.strip()[:500]}")
    os.replace(tmp, target)  # concurrent builders each publish a complete file


@functools.cache
def _library() -> ctypes.CDLL:
    target = _library_path()
    if not target.is_file():
        _build(target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailable(f"loading {target.name} failed: {exc}") from exc
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
    try:
        _library()
    except KernelUnavailable:
        return False
    return True


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
