"""`ferry registry serve --proxy` as operators run it, and the settings behind it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, free_port

from ferry.config import ConfigError, Settings, parse_mirrors
from registry.store import Store

from .proxy_fixtures import publish, upstream_registry


def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            httpx.get(f"{url}/v2/", timeout=2)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "registry did not start"
            time.sleep(0.1)


def test_registry_serve_proxy_mirrors_the_upstream_and_keeps_local_namespaces(
        tmp_path: Path) -> None:
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = asyncio.run(publish(Store(tmp_path / "source"),
                                  f"{upstream.host}/library/tiny:v1", [500], tmp_path / "pub"))
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ferry.cli", "registry", "serve", "--port", str(port),
             "--root", str(tmp_path / "root"), "--proxy", f"http://u:secret@{upstream.host}",
             "--proxy-ttl", "60", "--proxy-local", "team"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                 "FERRY_HOME": str(tmp_path / "home")})
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(proc, url)
            got = httpx.get(f"{url}/v2/library/tiny/manifests/v1", timeout=30)
            assert got.status_code == 200 and got.content == raw
            denied = httpx.post(f"{url}/v2/library/tiny/blobs/uploads/", timeout=30)
            assert denied.status_code == 403
            assert "secret" not in denied.text
            assert httpx.post(f"{url}/v2/team/x/blobs/uploads/", timeout=30).status_code == 202
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
    assert f"mirroring http://{upstream.host}" in out and "secret" not in out


def test_mirror_and_proxy_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env({
        "FERRY_MIRRORS": "registry.ollama.ai=http://mirror.lan:5000, docker.io=mirror.example",
        "FERRY_MIRRORS_ONLY": "1",
        "FERRY_REGISTRY_PROXY": "library=https://registry.ollama.ai,http://10.0.0.5:5000",
        "FERRY_REGISTRY_PROXY_TTL": "5m",
        "FERRY_REGISTRY_PROXY_MAX_BYTES": "1000",
        "FERRY_REGISTRY_PROXY_LOCAL": "team,/ops/",
    })
    assert settings.mirrors == (("registry.ollama.ai", "http://mirror.lan:5000"),
                                ("docker.io", "https://mirror.example"))
    assert settings.mirrors_only
    assert settings.registry_proxy_ttl == 300.0
    assert settings.registry_proxy_max_bytes == 1000
    assert settings.registry_proxy_local == ("team", "ops")
    from ferry.app import proxy_config

    config = proxy_config(settings)
    assert config is not None
    assert config.upstream_for("library/llama3.2").shown == "https://registry.ollama.ai"
    assert config.upstream_for("other/model").shown == "http://10.0.0.5:5000"
    assert config.upstream_for("team/model") is None


@pytest.mark.parametrize("value", ["registry.ollama.ai", "host=ftp://x", "=http://x",
                                   "host=http://u:p@x", "host=http://x/path"])
def test_a_bad_mirror_entry_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError, match="FERRY_MIRRORS"):
        parse_mirrors(value)


def test_a_bad_proxy_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="FERRY_REGISTRY_PROXY"):
        Settings.from_env({"FERRY_REGISTRY_PROXY": "ftp://upstream"})
