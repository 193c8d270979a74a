"""Blobs as repositories see them: bytes stored once, linked into each repository that may serve
them. A blob push links the blob into its repository; a mount links an existing blob into another;
DELETE unlinks it, and gc.py removes bytes no link reaches any more.
"""

from __future__ import annotations

import time

from registry.digests import Digest
from registry.service import paths
from registry.service.storage.base import BlobStore, Stat

FRESH_LINK = 600.0  # seconds; gc's grace period must be longer than this (default 3600)


class Blobs:
    def __init__(self, store: BlobStore) -> None:
        self.store = store

    async def stat(self, repo: str, digest: Digest) -> Stat | None:
        """The blob's size and time when `repo` may serve it, else None."""
        if await self.store.stat(paths.layer_link(repo, digest)) is None:
            return None
        return await self.store.stat(paths.blob(digest))

    async def stat_for_manifest(self, repo: str, digest: Digest) -> Stat | None:
        """Like `stat`, for a manifest about to reference the blob: a link older than
        FRESH_LINK seconds is rewritten, so gc's grace period covers the blob until the manifest
        (which then marks it) is stored."""
        link = await self.store.stat(paths.layer_link(repo, digest))
        if link is None:
            return None
        stat = await self.store.stat(paths.blob(digest))
        if stat is not None and time.time() - link.mtime > FRESH_LINK:
            await self.link(repo, digest)
        return stat

    async def stat_anywhere(self, digest: Digest) -> Stat | None:
        return await self.store.stat(paths.blob(digest))

    async def link(self, repo: str, digest: Digest) -> None:
        await self.store.put(paths.layer_link(repo, digest), b"")

    async def unlink(self, repo: str, digest: Digest) -> bool:
        """Remove the repository's link; False when it had none."""
        key = paths.layer_link(repo, digest)
        if await self.store.stat(key) is None:
            return False
        await self.store.delete(key)
        return True

    async def mount(self, repo: str, digest: Digest, source: str | None) -> bool:
        """Link a blob already stored into `repo`: from `source` when given (and it holds the
        blob), else from anywhere in the registry. False when there is nothing to mount.
        """
        if source is not None:
            if await self.stat(source, digest) is None:
                return False
        elif await self.stat_anywhere(digest) is None:
            return False
        await self.link(repo, digest)
        return True


async def list_repositories(store: BlobStore) -> list[str]:
    """Every repository name, sorted: directories under `repositories/` that hold `_`-dirs."""
    found: list[str] = []

    async def walk(prefix: str, name: str) -> None:
        children = await store.list(prefix)
        if any(child in paths.RESERVED for child in children):
            found.append(name)
        for child in children:
            if not child.startswith("_"):
                await walk(f"{prefix}/{child}", f"{name}/{child}" if name else child)

    await walk(paths.REPOSITORIES, "")
    return sorted(found)
