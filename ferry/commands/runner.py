"""`ferry runner --model NAME --port P`: one model's runner process (hidden; the model server
spawns it, docs/runner-protocol.md).

On Linux the float32 compute path hands every matmul to BLAS (the fused path its prefill's),
and the BLAS linked into the mlx[cpu] wheel is a slow reference one; Debian's OpenBLAS, when
installed, is ~75x faster. A library must be preloaded before the process starts, so the
command re-executes itself once with LD_PRELOAD naming OpenBLAS. The scheduler need not know: it
just runs `ferry runner`. The LD_PRELOAD value itself guards against a loop (a second start sees
it and goes on).

A runner holds a model's memory, so it must not outlive the server that spawned it, even one
killed with SIGKILL (no cleanup runs then): `die_with_parent` asks Linux for SIGKILL when the
parent goes (prctl PR_SET_PDEATHSIG), and elsewhere watches the parent pid from a thread.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ferry.config import Settings

HIDDEN = {"runner"}
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_SECONDS = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "runner", help="serve one model for the model server (internal)",
        description="Load one model from the local store with MLX and serve the runner "
                    "protocol (GET /v1/status, POST /v1/completions, POST /v1/tokenize) on "
                    "127.0.0.1. Started by `ferry serve`; FERRY_COMPUTE=auto|native|float32|fused "
                    "picks the compute path.")
    parser.add_argument("--model", required=True, help="model name in the local store")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.set_defaults(func=run)


def preload_env(settings: Settings, blas: Path = OPENBLAS) -> dict[str, str] | None:
    """The environment to re-execute with so OpenBLAS is preloaded; None when not needed."""
    env = settings.child_env()
    preload = env.get("LD_PRELOAD", "")
    if (settings.compute == "native" or not sys.platform.startswith("linux")
            or not blas.is_file() or str(blas) in preload.split(":")):
        return None
    env["LD_PRELOAD"] = f"{blas}:{preload}" if preload else str(blas)
    return env


def die_with_parent(parent: int | None = None) -> None:
    """Exit (SIGKILL) as soon as the parent process is gone. `parent`: the pid this process
    started under (default: the current parent), so a parent that died before the call counts.
    """
    parent = os.getppid() if parent is None else parent
    if not (sys.platform.startswith("linux") and _set_parent_death_signal()):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True,
                         name="ferry-parent-watch").start()
    if os.getppid() != parent:  # it went before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def run(args: argparse.Namespace, settings: Settings) -> int:
    die_with_parent()  # first, before loading anything (and again after the re-exec below)
    env = preload_env(settings)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
    import uvicorn

    from registry.store import Store
    from runner.load import return_large_frees
    from runner.server import build_app

    return_large_frees()  # before the model's first byte: freed tensors leave nothing resident

    server: uvicorn.Server | None = None
    failure: list[str] = []

    def on_fail(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = build_app(Store(settings.models_dir), args.model, settings.compute, on_fail=on_fail,
                    prefix_cache_bytes=settings.prefix_cache_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="warning", timeout_graceful_shutdown=2))
    if failure:
        return 1
    server.run()
    return 1 if failure else 0
