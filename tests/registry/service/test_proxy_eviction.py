"""The cache is ordinary storage: gc keeps mirrored models, the size cap evicts the least
recently pulled one first and never a blob a kept model needs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from registry.manifests import parse_manifest
from registry.service.gc import MIN_GRACE, collect_garbage
from registry.service.proxy import keys
from registry.service.proxy.eviction import Eviction
from registry.service.registry import Registry
from registry.service.storage.filesystem import FilesystemStore
from registry.store import Store
from registry.transfer.pull import pull
from tests.registry.transfer.helpers import fast_options

from .proxy_fixtures import proxy_config, proxy_registry, publish, upstream_registry


def _age(path: Path, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(path, (when, when))


async def test_gc_keeps_mirrored_models_and_the_cap_evicts_the_least_recently_pulled(
        tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    root = tmp_path / "proxy"
    with upstream_registry(tmp_path / "upstream") as upstream:
        # Same seed: both models share their first layer; each has one of its own.
        a = parse_manifest(await publish(source, f"{upstream.host}/library/a:latest",
                                         [30_000, 20_000], tmp_path / "pub", seed=7), None)
        b = parse_manifest(await publish(source, f"{upstream.host}/library/b:latest",
                                         [30_000, 25_000, 5_000], tmp_path / "pub", seed=7),
                           None)
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph", max_bytes=60_000)
        with proxy_registry(root, config) as (proxy, _app):
            for model in ("a", "b"):
                await pull(f"{proxy}/library/{model}", Store(tmp_path / f"c-{model}"),
                           fast_options(tmp_path / "c", insecure=True), lambda e: None)

            store = FilesystemStore(root)
            # as if the grace period had passed: only what no manifest references may go
            report = await collect_garbage(store, grace=MIN_GRACE, now=time.time() + 2 * MIN_GRACE)
            assert report.swept == []  # mirrored tags are references like pushed ones

            registry = Registry.open(store)
            nothing = await Eviction(registry, config).run()
            assert nothing.forgotten == []  # just pulled: protected, though over the cap

            # b was pulled longest ago (a pull of a came later), so b goes first.
            _age(root / keys.used("library/a", a.digest), 100)
            _age(root / keys.used("library/b", b.digest), 200)
            for blob in (root / "blobs").rglob("*"):
                if blob.is_file():
                    _age(blob, 300)
            report = await Eviction(registry, config).run()
            assert report.forgotten == [("library/b", b.digest)]
            assert report.stored_bytes <= 60_000
            shared = a.layers[0].digest
            own_b = {d.digest for d in b.references()} - {d.digest for d in a.references()}
            assert set(report.deleted) == own_b | {b.digest}
            assert await store.stat(f"blobs/sha256/{shared.hex[:2]}/{shared.hex}") is not None
            assert await registry.tags.current("library/b", "latest") is None

            upstream.stop.close()  # a is still whole in the cache
            await pull(f"{proxy}/library/a", Store(tmp_path / "again"),
                       fast_options(tmp_path / "c", insecure=True), lambda e: None)
            async with httpx.AsyncClient(timeout=30) as http:
                for digest in own_b:
                    gone = await http.get(f"http://{proxy}/v2/library/b/blobs/{digest}")
                    assert gone.status_code == 502  # evicted, and the upstream is down
