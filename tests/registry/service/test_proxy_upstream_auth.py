"""Upstream credentials are the proxy's own (Basic for the token, or its Ed25519 key), and a
client's `Authorization` is never forwarded upstream."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from registry.service.app import build_registry_app
from registry.store import Store
from tests.registry.transfer.fakes import RequestLog, TokenAuth

from .proxy_fixtures import proxy_config, proxy_registry, publish


@pytest.mark.parametrize("credentials", ["ops:pw@", ""])
async def test_the_proxy_authenticates_upstream_with_its_own_credentials(
        tmp_path: Path, credentials: str) -> None:
    auth = TokenAuth(build_registry_app(tmp_path / "upstream"), realm="", password=("ops", "pw"))
    log = RequestLog(auth)
    with serve_app(log) as url:
        auth.realm = f"{url}/token"
        host = url.removeprefix("http://")
        raw = await publish(Store(tmp_path / "source"), f"{host}/ns/model:v1", [3000],
                            tmp_path / "publisher")  # signs with the publisher's key
        token_requests = len(auth.token_requests)
        config = proxy_config(f"http://{credentials}{host}", tmp_path / "proxy-home")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            async with httpx.AsyncClient(timeout=30) as http:
                got = await http.get(f"http://{proxy}/v2/ns/model/manifests/v1",
                                     headers={"Authorization": "Bearer client-secret"})
    assert got.status_code == 200 and got.content == raw
    assert "client-secret" not in " ".join(log.authorizations)
    used = auth.token_requests[token_requests]["authorization"]
    if credentials:
        assert used.startswith("Basic ")
    else:  # no password configured: the proxy's own Ed25519 key, created in its home
        assert not used.startswith("Basic ") and (tmp_path / "proxy-home" / "id_ed25519").exists()
