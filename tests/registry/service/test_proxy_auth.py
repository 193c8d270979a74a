"""A pull-through cache behind accounts: a mirrored repository is authorized like any other
before anything is fetched upstream, and writes to it are still refused."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import serve_app

from registry.service.app import build_registry_app
from registry.service.auth.config import load_auth_config
from registry.store import Store

from .auth_fixtures import basic, get_token, write_auth_file
from .conftest import push_blob
from .proxy_fixtures import proxy_config, proxy_registry, publish, upstream_registry


async def test_a_mirrored_repository_needs_a_token_before_anything_is_fetched(
        tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        await publish(source, f"{upstream.host}/team/m:v1", [20_000], tmp_path / "pub")
        before = len(upstream.log.requests)
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        app = build_registry_app(tmp_path / "proxy", proxy=config,
                                 auth=load_auth_config(write_auth_file(tmp_path)))
        with serve_app(app) as url:
            anonymous = httpx.get(f"{url}/v2/team/m/manifests/v1")
            assert anonymous.status_code == 401
            assert 'scope="repository:team/m:pull' in anonymous.headers["www-authenticate"]
            assert len(upstream.log.requests) == before  # nothing was asked of the upstream

            token = get_token(url, basic("bob", "bob-pw"), "repository:team/m:pull,push")
            headers = {"Authorization": f"Bearer {token}"}
            pulled = httpx.get(f"{url}/v2/team/m/manifests/v1", headers=headers)
            assert pulled.status_code == 200, pulled.text
            pushed = httpx.put(f"{url}/v2/team/m/manifests/v2", headers=headers,
                               content=pulled.content)
            assert pushed.status_code in (401, 403)


async def test_a_local_repositorys_blob_is_not_served_through_a_mirrored_one(
        tmp_path: Path) -> None:
    """The cache is one store: a blob pushed to a local namespace must not be readable under a
    mirrored repository whose upstream does not hold it (it would bypass the local rules)."""
    with upstream_registry(tmp_path / "upstream") as upstream:
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph", local=("team",))
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            async with httpx.AsyncClient(base_url=f"http://{proxy}") as http:
                digest = await push_blob(http, "team/private", b"secret weights")
                leaked = await http.get(f"/v2/library/public/blobs/{digest}")
                assert leaked.status_code == 404, leaked.text
                assert (await http.get(f"/v2/team/private/blobs/{digest}")).content == (
                    b"secret weights")
