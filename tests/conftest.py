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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL of a real S3-compatible server: moto's server mode in a subprocess on a free
    loopback port, or whatever FERRY_TEST_S3_ENDPOINT names (then nothing is started).
    Credentials for moto are any strings; tests set AWS_ACCESS_KEY_ID etc. themselves."""
    external = os.environ.get("FERRY_TEST_S3_ENDPOINT")
    if external:
        yield external
        return
    import httpx

    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    cmd = [sys.executable, "-m", "tests.s3_test_server"]  # moto, with atomic conditional PUTs
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto_server did not start on {url}") from None
            time.sleep(0.1)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def runner_processes() -> list:
    """Live runner processes (the real `ferry runner` or the stand-in) below this test process.

    Tests check runners by process, but the test session has other children (the S3 server), so
    a bare `children()` would count, or kill, the wrong process."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and any(
                    "runner" in part for part in proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found
