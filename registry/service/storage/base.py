"""The BlobStore protocol: bytes by key, nothing more.

A store knows nothing of digests, repositories or manifests; `paths.py` names the keys and the
layers above give them meaning. Keys are `/`-separated relative paths. Every implementation runs
the one conformance suite in `tests/registry/service/test_storage.py`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# Marks a key being written (`<key>~tmp-<id>`). No repository, tag or digest can contain `~`
# (names.parse_repository, the tag grammar, sha256 hex), so it never hides a legal name.
STAGING_MARKER = "~tmp-"
# What ferry staged before the marker changed: `<leaf>.tmp-<hex>`, where the leaf is one the
# layout writes (a digest or a fixed file name), never a user's repository or tag name.
_LEGACY_STAGING = re.compile(
    r"(?:[0-9a-f]{64}|current|history|session|data)\.tmp-[0-9a-f]{12}(?:[0-9a-f]{20})?")


def is_staged_leaf(name: str) -> bool:
    """Whether the last component of a key names a staged object (current or legacy form)."""
    return STAGING_MARKER in name or _LEGACY_STAGING.fullmatch(name) is not None


class KeyNotFound(Exception):
    """The key holds no object (or, for `list`, no children)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


@dataclass(frozen=True)
class Stat:
    size: int
    mtime: float  # seconds since the epoch of the last write


class BlobStore(Protocol):
    async def stat(self, key: str) -> Stat | None:
        """Size and modification time, or None when nothing is stored at `key`."""

    def read(
        self, key: str, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes | memoryview]:
        """Stream bytes [offset, offset+length) of `key` in pieces; KeyNotFound when absent.
        A piece may be a memoryview of a buffer nothing else uses (send it without copying)."""

    async def get(self, key: str) -> bytes:
        """The whole (small) object; KeyNotFound when absent."""

    async def put(self, key: str, data: bytes) -> None:
        """Store a small object atomically: readers see the old bytes or the new, never a mix."""

    async def get_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The whole (small) object and an opaque version token for `put_if`; (b"", None) when
        nothing is stored. Equal contents may share a version: a swap compares values."""

    async def put_if(self, key: str, data: bytes, expected: str | None) -> bool:
        """Compare-and-swap: store `data` only while `key` still holds version `expected` (None:
        only while absent), atomically even against other processes or replicas. False, with
        nothing written, when another writer got there first. A key written this way must only
        be written this way (a plain `put` does not take part in the swap)."""

    async def append(
        self, key: str, chunks: AsyncIterable[bytes | memoryview],
        observe: Callable[[bytes | memoryview], object] | None = None,
    ) -> int:
        """Append a stream to the object at `key` (created empty if absent); return bytes written.

        For staging uploads and logs. `observe` sees every appended byte, in order, possibly on a
        worker thread (so a hasher runs beside the event loop, not on it). The bytes written
        before a failure stay, so the caller learns the new size from `stat` and resumes there.
        """

    async def commit(self, key: str, staged: str) -> None:
        """Publish the staged object at `staged` as `key`, durably and atomically, then drop
        `staged`. The caller has verified the bytes; a crash leaves either no `key` or all of it.
        """

    async def delete(self, key: str) -> None:
        """Remove the object at `key`, or everything under it if it is a prefix; absent is fine."""

    async def list(self, prefix: str) -> list[str]:
        """Names of the direct children under `prefix`, sorted; [] when there are none."""

    async def staged(self) -> Sequence[tuple[str, Stat]]:
        """Every `<key>~tmp-<id>` in the store (a write in progress, or one a crash left behind),
        with its Stat, so gc can sweep the old ones; `list` never shows them."""

    def redirect_url(self, key: str) -> str | None:
        """A URL the client may fetch `key` from directly; None means the caller serves it."""

    def close(self) -> None:
        """Release what the store holds open (threads, connections) when a command is done."""
