"""The pull-through cache against a real upstream: ferry's own registry, both on loopback."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import httpx
from conftest import serve_app

from registry.manifests import parse_manifest
from registry.names import Name
from registry.service import paths
from registry.service.app import build_registry_app
from registry.service.proxy import keys
from registry.service.storage.base import Stat
from registry.service.storage.filesystem import FilesystemStore
from registry.store import Store
from registry.transfer.pull import pull
from tests.registry.transfer.helpers import blob_bytes, fast_options

from .proxy_fixtures import proxy_config, proxy_registry, publish, upstream_registry


async def test_four_clients_pull_through_the_proxy_and_upstream_serves_each_blob_once(
        tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = await publish(source, f"{upstream.host}/library/tiny:latest",
                            [600_000, 300_000, 2_000], tmp_path / "publisher")
        manifest = parse_manifest(raw, None)
        segment = 128 * 1024  # the 600 kB layer comes in 5 Range requests, 3 at a time
        config = proxy_config(f"http://{upstream.host}", tmp_path / "proxy-home",
                              segment_bytes=segment, segment_window=3)
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            name = f"{proxy}/library/tiny:latest"
            clients = [Store(tmp_path / f"client-{i}") for i in range(4)]
            await asyncio.gather(*(pull(name, c, fast_options(tmp_path / f"h{i}", insecure=True),
                                        lambda e: None) for i, c in enumerate(clients)))
            for desc in manifest.references():
                # each byte fetched once: one GET per segment, none repeated
                assert upstream.blob_gets(desc.digest) == -(-desc.size // segment), desc
                for client in clients:
                    assert blob_bytes(client, desc.digest) == blob_bytes(source, desc.digest)
            upstream.stop.close()  # the upstream is gone: the cache alone serves the model

            fresh = Store(tmp_path / "fresh")
            await pull(name, fresh, fast_options(tmp_path / "hf", insecure=True), lambda e: None)
            assert fresh.read_manifest(Name.parse_valid(name)) == raw
            for desc in manifest.references():
                assert blob_bytes(fresh, desc.digest) == blob_bytes(source, desc.digest)


def _expire(root: Path, repo: str, tag: str) -> None:
    """Make the tag's last upstream check older than any TTL used here (no sleeping)."""
    checked = root / keys.checked(repo, tag)
    when = time.time() - 3600
    os.utime(checked, (when, when))


async def test_a_tag_moved_upstream_shows_after_the_ttl_and_a_dead_upstream_serves_stale(
        tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    root = tmp_path / "proxy"
    with upstream_registry(tmp_path / "upstream") as upstream:
        name = f"{upstream.host}/library/tiny:latest"
        first = await publish(source, name, [1000], tmp_path / "pub", seed=1)
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph", ttl=600.0)
        with proxy_registry(root, config) as (proxy, _app):
            url = f"http://{proxy}/v2/library/tiny/manifests/latest"
            async with httpx.AsyncClient(timeout=30) as http:
                got = await http.get(url)
                assert (got.content, got.headers["x-ferry-cache"]) == (first, "fetched")
                second = await publish(source, name, [2000], tmp_path / "pub", seed=2)
                got = await http.get(url)
                assert (got.content, got.headers["x-ferry-cache"]) == (first, "hit")
                _expire(root, "library/tiny", "latest")
                got = await http.get(url)
                assert (got.content, got.headers["x-ferry-cache"]) == (second, "fetched")
                _expire(root, "library/tiny", "latest")
                heads = upstream.log.count("HEAD", "/manifests/latest")
                got = await http.get(url)
                assert (got.content, got.headers["x-ferry-cache"]) == (second, "revalidated")
                assert upstream.log.count("HEAD", "/manifests/latest") == heads + 1

                upstream.stop.close()
                got = await http.get(url)
                assert got.headers["x-ferry-cache"] == "hit"  # fresh again: not asked
                _expire(root, "library/tiny", "latest")
                got = await http.get(url)
                assert got.status_code == 200 and got.content == second
                assert got.headers["x-ferry-cache"] == "stale"
                assert "stale" in got.headers["warning"].lower()
                missing = await http.get(f"http://{proxy}/v2/library/other/manifests/latest")
                assert missing.status_code == 502
                assert missing.json()["errors"][0]["code"] == "UNAVAILABLE"


async def test_pushes_to_a_mirrored_namespace_are_denied_but_local_ones_work(
        tmp_path: Path) -> None:
    with upstream_registry(tmp_path / "upstream") as upstream:
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph", local=("team",))
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            async with httpx.AsyncClient(base_url=f"http://{proxy}", timeout=30) as http:
                denied = await http.post("/v2/library/tiny/blobs/uploads/")
                assert denied.status_code == 403
                error = denied.json()["errors"][0]
                assert error["code"] == "DENIED"
                assert f"mirrors http://{upstream.host}" in error["message"]
                put = await http.put("/v2/library/tiny/manifests/latest", content=b"{}")
                assert put.status_code == 403
                local = await http.post("/v2/team/tiny/blobs/uploads/")
                assert local.status_code == 202
            assert upstream.log.count("POST") == 0


async def test_the_tag_check_time_is_stored_beside_the_registry_tree(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        await publish(source, f"{upstream.host}/library/tiny:v1", [100], tmp_path / "pub")
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            async with httpx.AsyncClient(timeout=30) as http:
                got = await http.get(f"http://{proxy}/v2/library/tiny/manifests/v1")
                assert got.status_code == 200
    checked = tmp_path / "proxy" / keys.checked("library/tiny", "v1")
    assert checked.read_text() == got.headers["docker-content-digest"]


async def test_a_client_that_leaves_mid_blob_does_not_stop_the_fetch(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = await publish(source, f"{upstream.host}/library/big:latest", [8_000_000],
                            tmp_path / "pub")
        layer = parse_manifest(raw, None).layers[0].digest
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            url = f"http://{proxy}/v2/library/big/blobs/{layer}"
            async with httpx.AsyncClient(timeout=30) as http:
                async with http.stream("GET", url) as response:
                    assert response.headers["x-ferry-cache"] == "fetched"
                    async for _piece in response.aiter_raw():
                        break  # the client goes away after its first bytes
                got = await http.get(url)  # joins the fetch late (replayed), or finds it cached
                assert got.status_code == 200
                assert got.content == blob_bytes(source, layer)
                await _until_cached(http, url)  # it had its bytes before the commit and link
    assert upstream.blob_gets(layer) == 1


async def _until_cached(http: httpx.AsyncClient, url: str) -> None:
    """Wait for a fetched blob's commit and link: its client had the bytes before them."""
    for _ in range(400):
        if (await http.get(url)).headers["x-ferry-cache"] == "hit":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became a cache hit")


class StatCountingStore(FilesystemStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stats: Counter[str] = Counter()

    async def stat(self, key: str) -> Stat | None:
        self.stats[key] += 1
        return await super().stat(key)


async def test_a_cached_blob_is_looked_up_once_per_request(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = await publish(source, f"{upstream.host}/library/tiny:v1", [300_000],
                            tmp_path / "pub")
        layer = parse_manifest(raw, None).layers[0].digest
        store = StatCountingStore(tmp_path / "proxy")
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with serve_app(build_registry_app(store=store, proxy=config)) as url:
            blob_url = f"{url}/v2/library/tiny/blobs/{layer}"
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.get(blob_url)).headers["x-ferry-cache"] == "fetched"
                await _until_cached(http, blob_url)
                store.stats.clear()
                hit = await http.get(blob_url, headers={"Range": "bytes=10-19"})
    assert hit.status_code == 206 and hit.headers["x-ferry-cache"] == "hit"
    assert hit.content == blob_bytes(source, layer)[10:20]
    assert store.stats[paths.layer_link("library/tiny", layer)] == 1
    assert store.stats[paths.blob(layer)] == 1
