"""Tags: which manifest a name points at now, and every place it pointed before.

A tag move is one atomic object write (`current`) plus one appended history line, done under
a lock per repository, so two pushes to one tag never interleave and the history records every
move in the order this process made them. Across replicas the S3 store would make `current` a
conditional write; on one filesystem the lock and the atomic rename are enough.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from registry.digests import Digest
from registry.service import paths
from registry.service.storage.base import BlobStore, KeyNotFound

_TAG = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$")


def is_tag(reference: str) -> bool:
    return _TAG.match(reference) is not None


@dataclass(frozen=True)
class TagMove:
    at_ns: int
    digest: Digest


class TagStore:
    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self._locks: dict[str, asyncio.Lock] = {}
        self._last_ns = 0

    def lock(self, repo: str) -> asyncio.Lock:
        """The in-process lock that serializes every tag write in `repo`."""
        return self._locks.setdefault(repo, asyncio.Lock())

    async def current(self, repo: str, tag: str) -> Digest | None:
        try:
            raw = await self.store.get(paths.tag_current(repo, tag))
        except KeyNotFound:
            return None
        return Digest.parse(raw.decode().strip())

    async def move(self, repo: str, tag: str, digest: Digest) -> None:
        async with self.lock(repo):
            at_ns = max(time.time_ns(), self._last_ns + 1)
            self._last_ns = at_ns
            await self.store.put(paths.tag_current(repo, tag), str(digest).encode())
            await self.store.append(paths.tag_history(repo, tag), _one(f"{at_ns} {digest}\n"))

    async def remove(self, repo: str, tag: str) -> bool:
        """Untag: the tag disappears from listings, its history stays. False when absent."""
        async with self.lock(repo):
            key = paths.tag_current(repo, tag)
            if await self.store.stat(key) is None:
                return False
            await self.store.delete(key)
            return True

    async def history(self, repo: str, tag: str) -> list[TagMove]:
        """Every move of the tag, oldest first."""
        try:
            raw = await self.store.get(paths.tag_history(repo, tag))
        except KeyNotFound:
            return []
        moves = []
        for line in raw.decode().splitlines():
            at, _, digest = line.partition(" ")
            moves.append(TagMove(int(at), Digest.parse(digest)))
        return moves

    async def names(self, repo: str) -> list[str]:
        """Tags that point somewhere now, sorted."""
        found = []
        for tag in await self.store.list(paths.tags_dir(repo)):
            if await self.store.stat(paths.tag_current(repo, tag)) is not None:
                found.append(tag)
        return found

    async def tags_of(self, repo: str, digest: Digest) -> list[str]:
        return [t for t in await self.names(repo) if await self.current(repo, t) == digest]


async def _one(text: str) -> AsyncIterator[bytes]:
    yield text.encode()
