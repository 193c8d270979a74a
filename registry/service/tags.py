"""Tags: which manifest a name points at now, and every place it pointed before.

The history is the truth: a move appends its line with a compare-and-swap (`put_if`), so moves
from any number of replicas (or processes on one disk) are ordered by the store and none is lost.
`current` is then synced to the history's last line, again by compare-and-swap, reading the
version of `current` before the history: a writer that saw a stale history loses its swap, so
`current` always ends on the last move. A lock per repository keeps one process's own moves
from racing each other, so swaps only conflict between replicas.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass

from registry.digests import Digest
from registry.service import paths
from registry.service.errors import RegistryError
from registry.service.storage.base import BlobStore, KeyNotFound

_TAG = re.compile(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
MAX_SWAPS = 64  # compare-and-swap attempts per step before a move gives up (429: retry later)


def is_tag(reference: str) -> bool:
    return _TAG.fullmatch(reference) is not None


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
        """Point `tag` at `digest` and record the move; atomic across replicas."""
        async with self.lock(repo):
            await self._append_move(repo, tag, digest)
            await self._sync_current(repo, tag)

    async def _append_move(self, repo: str, tag: str, digest: Digest) -> None:
        key = paths.tag_history(repo, tag)
        for attempt in range(MAX_SWAPS):
            raw, version = await self.store.get_versioned(key)
            last = _parse(raw)[-1].at_ns if raw else 0
            at_ns = max(time.time_ns(), self._last_ns + 1, last + 1)  # strictly increasing
            if await self.store.put_if(key, raw + f"{at_ns} {digest}\n".encode(), version):
                self._last_ns = at_ns
                return
            await _backoff(attempt)
        raise _contended(repo, tag)

    async def _sync_current(self, repo: str, tag: str) -> None:
        key = paths.tag_current(repo, tag)
        for attempt in range(MAX_SWAPS):
            now, version = await self.store.get_versioned(key)  # before the history: see above
            wanted = str(_parse(await self.store.get(paths.tag_history(repo, tag)))[-1].digest)
            if now.decode().strip() == wanted or await self.store.put_if(
                    key, wanted.encode(), version):
                return
            await _backoff(attempt)
        raise _contended(repo, tag)

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
            return _parse(await self.store.get(paths.tag_history(repo, tag)))
        except KeyNotFound:
            return []

    async def names(self, repo: str) -> list[str]:
        """Tags that point somewhere now, sorted."""
        found = []
        for tag in await self.store.list(paths.tags_dir(repo)):
            if await self.store.stat(paths.tag_current(repo, tag)) is not None:
                found.append(tag)
        return found

    async def tags_of(self, repo: str, digest: Digest) -> list[str]:
        return [t for t in await self.names(repo) if await self.current(repo, t) == digest]


def _parse(raw: bytes) -> list[TagMove]:
    moves = []
    for line in raw.decode().splitlines():
        at, _, digest = line.partition(" ")
        moves.append(TagMove(int(at), Digest.parse(digest)))
    return moves


async def _backoff(attempt: int) -> None:
    """Jittered, capped: replicas that collided spread out instead of colliding again."""
    await asyncio.sleep(random.uniform(0, min(0.2, 0.005 * 2 ** min(attempt, 6))))


def _contended(repo: str, tag: str) -> RegistryError:
    return RegistryError("TOOMANYREQUESTS", f"tag {repo}:{tag} is being moved by other "
                         f"writers; {MAX_SWAPS} attempts to update it conflicted, retry later")
