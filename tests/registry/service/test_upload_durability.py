"""An acknowledged upload chunk survives kill -9 of the registry: after a restart the session
reports it, the client resumes from the reported offset, and the blob verifies."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import free_port

REPO = "library/durable"


def start_registry(root: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "ferry.cli", "registry", "serve",
                                "--host", "127.0.0.1", "--port", str(port), "--root", str(root)],
                               env={**os.environ, "FERRY_HOME": str(root.parent / "home")},
                               stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return process
        except httpx.TransportError:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)


def test_an_acknowledged_chunk_survives_kill_9_and_the_upload_resumes(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = start_registry(tmp_path / "reg", port)
    try:
        location = httpx.post(f"{url}/v2/{REPO}/blobs/uploads/").headers["Location"]
        r = httpx.patch(f"{url}{location}", content=data[:200_000],
                        headers={"Content-Range": "0-199999"})
        assert r.status_code == 202 and r.headers["Range"] == "0-199999"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    second = start_registry(tmp_path / "reg", port)
    try:
        r = httpx.get(f"{url}{location}")
        assert r.status_code == 204
        offset = int(r.headers["Range"].split("-")[1]) + 1
        assert offset == 200_000  # what was acknowledged is what the session holds
        r = httpx.patch(f"{url}{location}", content=data[offset:],
                        headers={"Content-Range": f"{offset}-{len(data) - 1}"})
        assert r.status_code == 202
        r = httpx.put(f"{url}{location}", params={"digest": digest})
        assert r.status_code == 201, r.text
        assert httpx.get(f"{url}/v2/{REPO}/blobs/{digest}").content == data
    finally:
        second.send_signal(signal.SIGKILL)
        second.wait(10)
