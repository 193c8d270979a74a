"""Build a kernel's C source once per source, compiler flags and CPU, and load it with ctypes.

The library goes to `runner/kernels/_build/` (or a private temp dir when the checkout is
read-only), named by a hash of what went into it, so a changed source or another CPU builds
anew and concurrent builders each publish a complete file. Without a compiler, loading raises
KernelUnavailable and the caller takes another path; a failed build is remembered for the
process (with one warning that says why), not retried on every call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
# Threads of one process (create's quantizing threads) may ask for a library at once: one builds.
_BUILD_LOCK = threading.Lock()
_FAILED: dict[tuple[Path, tuple[str, ...]], str] = {}
log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _library_path(source: Path, flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()
                         + _cpu_key().encode() + platform.machine().encode()).hexdigest()[:16]
    build = source.parent / "_build"
    try:
        build.mkdir(exist_ok=True)
        probe = build / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        build = Path(tempfile.mkdtemp(prefix="ferry-kernels-"))  # private, mode 0700
    return build / f"{source.stem}-{key}.so"


def _build(source: Path, target: Path, flags: tuple[str, ...]) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler found (install gcc)")
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    result = subprocess.run([compiler, *flags, "-o", str(tmp), str(source), "-lm"],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"building {source.name} failed: {result.stderr.strip()[:500]}")
    os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of the checkout from loading it
    os.replace(tmp, target)  # concurrent builders each publish a complete file


@functools.cache
def library(source: Path, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The compiled `source`, built now if needed; raises KernelUnavailable. Other `flags`
    (tests: a build without AVX2, for the portable loops) make another library."""
    with _BUILD_LOCK:
        if (source, flags) in _FAILED:
            raise KernelUnavailable(_FAILED[source, flags])
        try:
            return _load(source, flags)
        except KernelUnavailable as exc:
            _FAILED[source, flags] = str(exc)
            log.warning("%s: what uses %s takes its slower path (MLX) in this process; "
                        "install a C compiler (gcc) for the fast one", exc, source.name)
            raise


def _load(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    target = _library_path(source, flags)
    if not target.is_file():
        try:
            _build(source, target, flags)
        except OSError as exc:  # the build dir vanished or filled up, a compiler that won't run
            raise KernelUnavailable(f"building {source.name} failed: {exc}") from exc
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailable(f"loading {target.name} failed: {exc}") from exc


def loads(library: Callable[[], ctypes.CDLL]) -> bool:
    """True when `library()` (a kernel module's configured build) builds, now if needed, and
    loads; False where it cannot (the module's callers take another path)."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True
