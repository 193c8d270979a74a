"""The cache is ordinary storage: gc keeps mirrored models, the size cap evicts the least
recently pulled one first and never a blob a kept model needs."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from registry import media_types as mt
from registry.digests import Digest
from registry.manifests import Descriptor, build_manifest, parse_manifest
from registry.service import paths
from registry.service.gc import MIN_GRACE, collect_garbage
from registry.service.proxy import keys
from registry.service.proxy.config import ProxyConfig
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


# -- the cap on a store filled directly: what each run reads and deletes --------------------------


class CountingStore(FilesystemStore):
    """Counts reads of each key; `on_delete` runs before the first delete under a prefix."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: Counter[str] = Counter()
        self.on_delete: tuple[str, Callable[[], Awaitable[None]]] | None = None

    async def get(self, key: str) -> bytes:
        self.gets[key] += 1
        return await super().get(key)

    async def delete(self, key: str) -> None:
        if self.on_delete is not None and key.startswith(self.on_delete[0]):
            hook, self.on_delete = self.on_delete[1], None
            await hook()
        await super().delete(key)


async def _blob(registry: Registry, repo: str, data: bytes) -> Descriptor:
    digest = Digest.of(data)
    await registry.store.put(paths.blob(digest), data)
    await registry.blobs.link(repo, digest)
    return Descriptor(mt.MODEL, digest, len(data))


async def _model(registry: Registry, repo: str, layers: list[Descriptor]) -> Digest:
    """A mirrored model as the cache stores one: blobs linked, a revision, a tag."""
    config = await _blob(registry, repo, f"config of {repo}".encode())
    raw = build_manifest(Descriptor(mt.DOCKER_CONFIG, config.digest, config.size), layers)
    manifest = await registry.revisions.put(repo, raw, mt.DOCKER_MANIFEST)
    await registry.tags.move(repo, "latest", manifest.digest)
    return manifest.digest


def _age_all(root: Path, seconds: float) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            _age(path, seconds)


def _cap(tmp_path: Path, max_bytes: int) -> ProxyConfig:
    return proxy_config("http://127.0.0.1:9", tmp_path / "home", max_bytes=max_bytes,
                        local=("local",))


async def test_each_manifest_is_read_once_per_run_however_many_models_go(
        tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "root")
    registry = Registry.open(store)
    models = {}
    for n in range(4):
        repo = f"library/m{n}"
        layer = await _blob(registry, repo, bytes([n]) * 10_000)
        models[repo] = await _model(registry, repo, [layer])
    _age_all(tmp_path / "root", 300)
    for n, repo in enumerate(models):  # m0 cached (never pulled since) longest ago, m3 last
        _age(tmp_path / "root" / paths.revision_link(repo, models[repo]), 200 - n)
    store.gets.clear()

    report = await Eviction(registry, _cap(tmp_path, 25_000)).run()

    assert report.forgotten == [("library/m0", models["library/m0"]),
                                ("library/m1", models["library/m1"])]
    assert report.stored_bytes <= 25_000
    reads = {key: count for key, count in store.gets.items() if key.startswith("blobs/")}
    assert set(reads) == {paths.blob(d) for d in models.values()}  # manifests, never a layer
    kept = [paths.blob(models[repo]) for repo in ("library/m2", "library/m3")]
    assert [reads[key] for key in kept] == [1, 1]  # marked once, though two models went
    for repo in ("library/m2", "library/m3"):
        assert await registry.tags.current(repo, "latest") == models[repo]


async def test_unreferenced_mirrored_blobs_go_before_any_model_but_local_ones_stay(
        tmp_path: Path) -> None:
    registry = Registry.open(FilesystemStore(tmp_path / "root"))
    layer = await _blob(registry, "library/m", b"m" * 10_000)
    model = await _model(registry, "library/m", [layer])
    stray = await _blob(registry, "library/m", b"s" * 10_000)  # fetched by digest, no manifest
    pushed = await _blob(registry, "local/upload", b"l" * 10_000)  # a local push in progress
    _age_all(tmp_path / "root", 300)

    report = await Eviction(registry, _cap(tmp_path, 25_000)).run()

    assert report.forgotten == []
    assert report.deleted == [stray.digest]
    assert await registry.blobs.stat("local/upload", pushed.digest) is not None
    assert await registry.tags.current("library/m", "latest") == model


async def test_a_manifest_cached_while_the_cap_runs_keeps_the_blobs_it_names(
        tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "root")
    registry = Registry.open(store)
    shared = await _blob(registry, "library/old", b"s" * 10_000)
    old = await _model(registry, "library/old", [shared])
    newer = await _model(registry, "library/newer", [await _blob(registry, "library/newer",
                                                                 b"n" * 10_000)])
    _age_all(tmp_path / "root", 300)
    _age(tmp_path / "root" / paths.revision_link("library/newer", newer), 100)

    async def pulled_meanwhile() -> None:  # another request caches a model naming `shared`
        await registry.blobs.link("library/late", shared.digest)
        await _model(registry, "library/late", [shared])

    store.on_delete = (paths.revision_link("library/old", old), pulled_meanwhile)
    report = await Eviction(registry, _cap(tmp_path, 15_000)).run()

    assert report.forgotten == [("library/old", old)]
    assert shared.digest not in report.deleted
    assert old in report.deleted  # the forgotten manifest's own bytes go
    assert await store.stat(paths.blob(shared.digest)) is not None
