"""The size cap (`--proxy-max-bytes`): least recently pulled mirrored models go first.

When the stored blobs pass the cap, the mirrored manifest pulled longest ago is forgotten (its
tags, its revision, its proxy keys), then every blob no kept manifest references, and no local
repository links, is deleted; repeat until under the cap. A blob a kept manifest needs is never
deleted, and neither is anything touched in the last `PROTECT` seconds (a pull in progress), so a
cap smaller than one model keeps that model rather than breaking its pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from registry.digests import Digest
from registry.manifests import parse_manifest
from registry.service import paths
from registry.service.blobs import list_repositories
from registry.service.proxy import keys
from registry.service.proxy.config import ProxyConfig
from registry.service.registry import Registry
from registry.service.storage.base import Stat

log = logging.getLogger("ferry.registry.proxy")
PROTECT = 60.0


@dataclass
class EvictionReport:
    forgotten: list[tuple[str, Digest]] = field(default_factory=list)
    deleted: list[Digest] = field(default_factory=list)
    stored_bytes: int = 0  # after eviction


class Eviction:
    def __init__(self, registry: Registry, config: ProxyConfig) -> None:
        self.registry = registry
        self.config = config
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def soon(self) -> None:
        """Run once more after the current run (a blob was just stored); never two at once."""
        if not self.config.max_bytes:
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.create_task(self._runs())

    async def _runs(self) -> None:
        while True:
            self._again = False
            try:
                await self.run()
            except Exception:
                log.exception("evicting mirrored models failed")
            if not self._again:
                return

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self, now: float | None = None) -> EvictionReport:
        now = time.time() if now is None else now
        report = EvictionReport()
        blobs = await _stored_blobs(self.registry)
        total = sum(stat.size for stat in blobs.values())
        if total > self.config.max_bytes:
            for used, repo, digest in await self._candidates():
                if total <= self.config.max_bytes or now - used < PROTECT:
                    break
                await self._forget(repo, digest)
                report.forgotten.append((repo, digest))
                total -= await self._sweep(blobs, now, report)
        report.stored_bytes = total
        return report

    async def _candidates(self) -> list[tuple[float, str, Digest]]:
        """Every mirrored manifest with when it was last pulled, oldest first."""
        store = self.registry.store
        found = []
        for repo in await list_repositories(store):
            if self.config.upstream_for(repo) is None:
                continue
            for digest in await self.registry.revisions.digests(repo):
                stat = (await store.stat(keys.used(repo, digest))
                        or await store.stat(paths.revision_link(repo, digest)))
                found.append((stat.mtime if stat else 0.0, repo, digest))
        return sorted(found, key=lambda c: c[0])

    async def _forget(self, repo: str, digest: Digest) -> None:
        reg = self.registry
        for tag in await reg.tags.tags_of(repo, digest):
            await reg.tags.remove(repo, tag)
            await reg.store.delete(keys.checked(repo, tag))
        await reg.revisions.delete(repo, digest)
        await reg.store.delete(keys.used(repo, digest))
        log.info("size cap: forgot %s@%s", repo, digest)

    async def _sweep(self, blobs: dict[Digest, Stat], now: float,
                     report: EvictionReport) -> int:
        """Delete blobs nothing kept needs; return the bytes freed."""
        repos = await list_repositories(self.registry.store)
        needed = await _referenced(self.registry, repos)
        local = [r for r in repos if self.config.upstream_for(r) is None]
        freed = 0
        for digest, stat in list(blobs.items()):
            if digest in needed or now - stat.mtime < PROTECT:
                continue
            if any([await self.registry.blobs.stat(r, digest) for r in local]):
                continue
            await self.registry.store.delete(paths.blob(digest))
            for repo in repos:
                await self.registry.store.delete(paths.layer_link(repo, digest))
            del blobs[digest]
            report.deleted.append(digest)
            freed += stat.size
        return freed


async def _stored_blobs(registry: Registry) -> dict[Digest, Stat]:
    store = registry.store
    found: dict[Digest, Stat] = {}
    for shard in await store.list(paths.BLOBS):
        for hex_ in await store.list(f"{paths.BLOBS}/{shard}"):
            if len(hex_) == 64:
                stat = await store.stat(f"{paths.BLOBS}/{shard}/{hex_}")
                if stat is not None:
                    found[Digest(hex_)] = stat
    return found


async def _referenced(registry: Registry, repos: list[str]) -> set[Digest]:
    """Every manifest any repository holds, and everything those manifests name."""
    needed: set[Digest] = set()
    for repo in repos:
        for digest in await registry.revisions.digests(repo):
            needed.add(digest)
            try:
                stored = await registry.revisions.get(repo, digest)
                manifest = parse_manifest(stored.raw, stored.media_type, len(stored.raw))
            except Exception as exc:  # never let one bad manifest stop the cap
                log.warning("size cap: %s@%s is unreadable (%s)", repo, digest, exc)
                continue
            needed.update(d.digest for d in manifest.references())
            if manifest.subject is not None:
                needed.add(manifest.subject.digest)
    return needed
