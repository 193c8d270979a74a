"""Garbage collection: remove blob bytes that nothing references any more.

Mark: every manifest a repository holds (its revisions, hence every tag's target) is a root; each
marks its own bytes, its config and layers, its index children and its subject. Sweep: a blob
that is not marked goes, unless it is younger than the grace period or a repository linked it
within the grace period: that is how an upload or mount in flight, whose manifest has not
arrived yet, keeps its blobs (uploads re-publish, so even a deduplicated blob looks young).
Ages are read blob by blob during the sweep, so a blob touched during the mark survives.

Two things keep a manifest pushed while gc runs from losing its blobs. Before sweeping, the mark
looks again for revisions stored since it started (a second pass over what it had not seen), so
correctness does not rest on timing alone. A manifest stored after that second look refreshed
every link it uses that was older than FRESH_LINK (blobs.py), so its blobs are younger than the
grace period, which therefore may not be shorter than MIN_GRACE.
Staged `*~tmp-*` objects past the grace period go too: a writer that crashed mid-commit left them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from registry.digests import Digest
from registry.errors import FerryError
from registry.manifests import parse_manifest
from registry.service import paths
from registry.service.blobs import FRESH_LINK, list_repositories
from registry.service.storage.base import BlobStore, KeyNotFound

log = logging.getLogger("ferry.registry.gc")
DEFAULT_GRACE = 3600.0
MIN_GRACE = 2 * FRESH_LINK  # a refreshed link stays young while its manifest PUT finishes


class GraceTooShort(ValueError):
    """A grace period that would let a manifest push in flight lose its blobs."""

    def __init__(self, grace: float) -> None:
        super().__init__(f"--grace {grace:g} is below the safe minimum of {MIN_GRACE:g} seconds "
                         "(a manifest pushed while gc runs could lose its blobs)")


@dataclass
class GCReport:
    marked: set[Digest] = field(default_factory=set)
    swept: list[Digest] = field(default_factory=list)
    kept_young: list[Digest] = field(default_factory=list)
    freed_bytes: int = 0
    staging_swept: list[str] = field(default_factory=list)  # keys of stale `~tmp-` leftovers


async def collect_garbage(
    store: BlobStore, grace: float = DEFAULT_GRACE, dry_run: bool = False,
    now: float | None = None,
) -> GCReport:
    if grace < MIN_GRACE:
        raise GraceTooShort(grace)
    report = GCReport()
    seen: set[tuple[str, Digest]] = set()
    await mark(store, report.marked, seen)
    now = time.time() if now is None else now
    candidates = [d for d in await all_blobs(store) if d not in report.marked]
    await mark(store, report.marked, seen)  # manifests stored while the first pass ran
    repos = await list_repositories(store)
    for digest in candidates:
        if digest in report.marked:
            continue
        touched = await _last_touched(store, digest, repos)
        if touched is None:
            continue
        size, mtime = touched
        if now - mtime < grace:
            report.kept_young.append(digest)
            continue
        report.swept.append(digest)
        report.freed_bytes += size
        if not dry_run:
            await sweep_blob(store, digest, repos)
    await _sweep_staging(store, now - grace, dry_run, report)
    return report


async def _sweep_staging(store: BlobStore, before: float, dry_run: bool,
                         report: GCReport) -> None:
    """Staged objects last written before `before`: a live write touches its file far more
    often than the grace period, so an old one has no writer left."""
    for key, stat in await store.staged():
        if stat.mtime < before:
            report.staging_swept.append(key)
            report.freed_bytes += stat.size
            if not dry_run:
                await store.delete(key)


async def mark(store: BlobStore, marked: set[Digest], seen: set[tuple[str, Digest]]) -> None:
    """Mark from every revision of every repository not in `seen` (then add it there).
    The proxy's size cap (proxy/eviction.py) marks and sweeps with these functions too."""
    for repo in await list_repositories(store):
        for hex_ in await store.list(paths.revisions_dir(repo)):
            if (repo, Digest(hex_)) not in seen:
                seen.add((repo, Digest(hex_)))
                await mark_revision(store, repo, Digest(hex_), marked)


async def mark_revision(store: BlobStore, repo: str, digest: Digest,
                        marked: set[Digest]) -> None:
    """Mark one manifest: its own digest and everything it names."""
    marked.add(digest)
    try:
        raw = await store.get(paths.blob(digest))
        media_type = (await store.get(paths.revision_link(repo, digest))).decode()
        manifest = parse_manifest(raw, media_type, max_bytes=len(raw))
    except (KeyNotFound, FerryError) as exc:
        log.warning("gc: %s@%s is unreadable (%s); marking nothing from it", repo, digest, exc)
        return
    marked.update(d.digest for d in manifest.references())
    if manifest.subject is not None:
        marked.add(manifest.subject.digest)


async def _last_touched(
    store: BlobStore, digest: Digest, repos: list[str]
) -> tuple[int, float] | None:
    """The blob's size and the newest time it or any repository link to it was written."""
    stat = await store.stat(paths.blob(digest))
    if stat is None:
        return None
    newest = stat.mtime
    for repo in repos:
        link = await store.stat(paths.layer_link(repo, digest))
        if link is not None:
            newest = max(newest, link.mtime)
    return stat.size, newest


async def all_blobs(store: BlobStore) -> list[Digest]:
    found = []
    for shard in await store.list(paths.BLOBS):
        for hex_ in await store.list(f"{paths.BLOBS}/{shard}"):
            if len(hex_) == 64:
                found.append(Digest(hex_))
    return found


async def sweep_blob(store: BlobStore, digest: Digest, repos: list[str]) -> None:
    """Delete the blob's bytes and its link in each of `repos`."""
    await store.delete(paths.blob(digest))
    for repo in repos:
        await store.delete(paths.layer_link(repo, digest))
