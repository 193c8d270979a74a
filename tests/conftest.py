"""Shared test fixtures: real servers on loopback, temp stores, fixture checkpoints."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FERRY_SHARED_DIR", REPO.parent / "shared"))
MAKE_CHECKPOINT = SHARED / "fixtures" / "make_checkpoint.py"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_app(app, host: str = "127.0.0.1", **config) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def settings(tmp_path: Path):
    from ferry.config import Settings

    return Settings.from_env({"FERRY_HOME": str(tmp_path / "home")})


@pytest.fixture
def store(settings):
    from registry.store import Store

    settings.models_dir.mkdir(parents=True, exist_ok=True)
    return Store(settings.models_dir)


@pytest.fixture
def model_server(settings) -> Iterator[str]:
    """A real `ferry serve` app on a free loopback port; yields its base URL."""
    from ferry.app import build_model_server

    with serve_app(build_model_server(settings)) as url:
        yield url


_CHECKPOINTS: dict[tuple, Path] = {}


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Build (once per session per argument set) a random-weight HF checkpoint dir."""

    def build(arch: str = "llama", preset: str = "tiny", dtype: str = "bfloat16",
              shard_mb: float | None = None, tie: bool | None = None, seed: int = 0) -> Path:
        key = (arch, preset, dtype, shard_mb, tie, seed)
        if key not in _CHECKPOINTS:
            if not MAKE_CHECKPOINT.is_file():
                pytest.fail(f"fixture generator missing: {MAKE_CHECKPOINT} (set FERRY_SHARED_DIR)")
            out = tmp_path_factory.mktemp(f"ckpt-{arch}-{preset}-{dtype}")
            cmd = [sys.executable, str(MAKE_CHECKPOINT), "--out", str(out), "--arch", arch,
                   "--preset", preset, "--dtype", dtype, "--seed", str(seed), "--force"]
            if shard_mb is not None:
                cmd += ["--shard-mb", str(shard_mb)]
            if tie is not None:
                cmd.append("--tie-word-embeddings" if tie else "--no-tie-word-embeddings")
            subprocess.run(cmd, check=True, capture_output=True)
            _CHECKPOINTS[key] = out
        return _CHECKPOINTS[key]

    return build
