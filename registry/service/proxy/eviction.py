"""The size cap (`--proxy-max-bytes`): least recently pulled mirrored models go first.

When the stored blobs pass the cap, the mirrored manifest pulled longest ago is forgotten (its
tags, its revision, its proxy keys), and the blobs no kept manifest references, and no local
repository links, are deleted; then the next, until under the cap. The marking and sweeping are
gc.py's: every manifest is read once per run (its references counted), so forgetting a model
costs only its own references, and manifests cached while the run went on are marked before
anything is deleted. A blob a kept manifest needs is never deleted, and neither is anything
touched in the last `PROTECT` seconds (a pull in progress), so a cap smaller than one model
keeps that model rather than breaking its pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from registry.digests import Digest
from registry.service import gc, paths
from registry.service.blobs import list_repositories
from registry.service.proxy import keys
from registry.service.proxy.config import ProxyConfig
from registry.service.registry import Registry
from registry.service.storage.base import BlobStore, Stat

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
        blobs = await _stored_blobs(self.registry.store)
        total = sum(stat.size for stat in blobs.values())
        if total > self.config.max_bytes:
            total -= await self._evict(blobs, total - self.config.max_bytes, now, report)
        report.stored_bytes = total
        return report

    async def _evict(self, blobs: dict[Digest, Stat], excess: int, now: float,
                     report: EvictionReport) -> int:
        """Forget the least recently pulled models until `excess` bytes may go; delete what
        nothing kept needs; return the bytes freed."""
        store = self.registry.store
        repos = await list_repositories(store)
        local = [r for r in repos if self.config.upstream_for(r) is None]
        names: dict[tuple[str, Digest], set[Digest]] = {}  # each manifest: what it marks
        for repo in repos:
            for digest in await self.registry.revisions.digests(repo):
                marked: set[Digest] = set()
                await gc.mark_revision(store, repo, digest, marked)
                names[(repo, digest)] = marked
        needed = Counter(d for marked in names.values() for d in marked)
        doomed = [d for d in blobs if not needed[d] and await self._may_delete(d, blobs, now,
                                                                               local)]
        excess -= sum(blobs[d].size for d in doomed)
        for used, repo, digest in await self._candidates(list(names)):
            if excess <= 0 or now - used < PROTECT:
                break
            await self._forget(repo, digest)
            report.forgotten.append((repo, digest))
            forgotten = names.pop((repo, digest))
            needed.subtract(forgotten)
            for blob in forgotten:
                if blob in blobs and needed[blob] <= 0 and blob not in doomed and (
                        await self._may_delete(blob, blobs, now, local)):
                    doomed.append(blob)
                    excess -= blobs[blob].size
        late: set[Digest] = set()  # what manifests cached during this run name
        await gc.mark(store, late, set(names) | set(report.forgotten))
        freed = 0
        for blob in doomed:
            if blob not in late:
                await gc.sweep_blob(store, blob, repos)
                report.deleted.append(blob)
                freed += blobs.pop(blob).size
        return freed

    async def _may_delete(self, digest: Digest, blobs: dict[Digest, Stat], now: float,
                          local: list[str]) -> bool:
        """Not written in the last PROTECT seconds, and linked into no local repository."""
        if now - blobs[digest].mtime < PROTECT:
            return False
        return not any([await self.registry.blobs.stat(r, digest) for r in local])

    async def _candidates(self, manifests: list[tuple[str, Digest]]
                          ) -> list[tuple[float, str, Digest]]:
        """The mirrored manifests with when each was last pulled, oldest first."""
        store = self.registry.store
        found = []
        for repo, digest in manifests:
            if self.config.upstream_for(repo) is None:
                continue
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


async def _stored_blobs(store: BlobStore) -> dict[Digest, Stat]:
    found: dict[Digest, Stat] = {}
    for digest in await gc.all_blobs(store):
        stat = await store.stat(paths.blob(digest))
        if stat is not None:
            found[digest] = stat
    return found
