"""`ferry registry serve` as operators run it: a real process on a loopback port."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import REPO, free_port


def test_registry_serve_runs_the_v2_api_on_the_given_port_and_root(tmp_path: Path) -> None:
    port = free_port()
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry.cli", "registry", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--root", str(root)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                r = httpx.get(f"{url}/v2/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "registry did not start"
                time.sleep(0.1)
        assert r.status_code == 200
        assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
        r = httpx.post(f"{url}/v2/ops/check/blobs/uploads/",
                       params={"digest": "sha256:" + "0" * 64}, content=b"x")
        assert r.status_code == 400  # wrong digest: verified, not stored
        r = httpx.post(f"{url}/v2/ops/check/blobs/uploads/")
        assert r.status_code == 202
        assert (root / "repositories" / "ops" / "check" / "_uploads").is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
