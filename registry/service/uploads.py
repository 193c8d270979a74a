"""Upload sessions: chunked, resumable, verified blob uploads.

A session is two objects in storage (paths.upload_session, paths.upload_data), never process
memory, so it survives a restart and any replica can continue it. The sha256 state cannot be
serialized, so each process keeps a hasher per session as a cache: the data object only grows by
appends at its end, so a cached hasher of the first N bytes stays right, and the process catches
up by hashing only the bytes it has not seen (all of them after a restart).

Durability, the guarantee a client may rely on: an acknowledged PATCH's bytes are in storage
when the 202 goes out (written to the file, or a finished S3 segment), so they survive the
registry process being killed, kill -9 included. They are not fsynced per chunk (that would
cost every upload a disk flush per PATCH); after a machine crash the session may hold fewer
bytes than were acknowledged. Either way the offset the session reports (GET on the upload,
the `Range` header) is what storage holds, so a client resumes by re-sending from that offset,
as the distribution spec describes; the final PUT verifies the digest over every byte, and the
commit fsyncs before publishing, so a gap can never become a published blob.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from registry.digests import Digest, Hasher
from registry.service import paths
from registry.service.blobs import Blobs, list_repositories
from registry.service.errors import RegistryError
from registry.service.storage.base import BlobStore

_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
# At most 18 ASCII digits a side: larger offsets exist in no upload, and int() of thousands of
# digits is slow and then refused by Python.
_CONTENT_RANGE = re.compile(r"(?:bytes[ =])?([0-9]{1,18})-([0-9]{1,18})(?:/(?:[0-9]+|\*))?")


@dataclass(frozen=True)
class Chunk:
    """Where a PATCH says its bytes go: inclusive [start, end], from `Content-Range`."""

    start: int
    end: int

    @classmethod
    def parse(cls, header: str) -> Chunk:
        match = _CONTENT_RANGE.fullmatch(header.strip())
        if match is None or int(match.group(2)) < int(match.group(1)):
            raise RegistryError("BLOB_UPLOAD_INVALID", f"invalid Content-Range {header!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def range_header(offset: int) -> str:
    """The `Range` a session reports: bytes received so far, inclusive (`0-0` when none)."""
    return f"0-{max(offset - 1, 0)}"


class Uploads:
    def __init__(self, store: BlobStore, blobs: Blobs, ttl: float, max_blob_bytes: int = 0
                 ) -> None:
        """`max_blob_bytes` > 0: a session that would grow past it is refused (413) and dropped."""
        self.store = store
        self.blobs = blobs
        self.ttl = ttl
        self.max_blob_bytes = max_blob_bytes
        self._hashers: dict[str, Hasher] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- session lifecycle ---------------------------------------------------------------------

    async def start(self, repo: str) -> str:
        upload_id = uuid.uuid4().hex
        record = {"repository": repo, "started": time.time()}
        await self.store.put(paths.upload_session(repo, upload_id), json.dumps(record).encode())
        return upload_id

    async def offset(self, repo: str, upload_id: str) -> int:
        """Bytes received so far; BLOB_UPLOAD_UNKNOWN when there is no such session."""
        await self._require(repo, upload_id)
        stat = await self.store.stat(paths.upload_data(repo, upload_id))
        return stat.size if stat else 0

    async def cancel(self, repo: str, upload_id: str) -> None:
        await self._require(repo, upload_id)
        await self._drop(repo, upload_id)

    async def _require(self, repo: str, upload_id: str) -> None:
        if not _UPLOAD_ID.fullmatch(upload_id) or (
            await self.store.stat(paths.upload_session(repo, upload_id)) is None
        ):
            raise RegistryError("BLOB_UPLOAD_UNKNOWN", detail={"uuid": upload_id})

    async def _drop(self, repo: str, upload_id: str) -> None:
        self._hashers.pop(upload_id, None)
        self._locks.pop(upload_id, None)
        await self.store.delete(paths.upload_dir(repo, upload_id))

    def _lock(self, upload_id: str) -> asyncio.Lock:
        return self._locks.setdefault(upload_id, asyncio.Lock())

    # -- receiving bytes -----------------------------------------------------------------------

    async def append(
        self, repo: str, upload_id: str, body: AsyncIterable[bytes], chunk: Chunk | None
    ) -> int:
        """Append a PATCH body; the chunk must start at the current offset (else 416 + Range)."""
        await self._require(repo, upload_id)  # before a lock exists for a made-up id
        async with self._lock(upload_id):
            offset = await self.offset(repo, upload_id)
            if chunk is not None and chunk.start != offset:
                raise RegistryError(
                    "UPLOAD_RANGE_INVALID",
                    f"chunk starts at {chunk.start}, the upload has {offset} bytes",
                    headers={"Range": range_header(offset), "Docker-Upload-UUID": upload_id},
                )
            await self._receive(repo, upload_id, offset, body)
            return await self.offset(repo, upload_id)

    async def _receive(
        self, repo: str, upload_id: str, offset: int, body: AsyncIterable[bytes]
    ) -> None:
        hasher = await self._hasher(repo, upload_id, offset)
        try:
            await self.store.append(paths.upload_data(repo, upload_id),
                                    self._within_limit(_nonempty(body), offset),
                                    observe=hasher.update)
        except _BlobTooLarge:
            # it can never become a valid blob: drop the session and its bytes, keep nothing
            await self._drop(repo, upload_id)
            raise self._too_large() from None
        finally:
            stat = await self.store.stat(paths.upload_data(repo, upload_id))
            if stat is None or stat.size != hasher.size:
                self._hashers.pop(upload_id, None)  # rebuilt from storage next time

    def _too_large(self) -> RegistryError:
        return RegistryError("BLOB_TOO_LARGE", f"blob exceeds the limit of "
                             f"{self.max_blob_bytes} bytes", detail={"limit": self.max_blob_bytes})

    async def _within_limit(self, body: AsyncIterable[bytes], offset: int
                            ) -> AsyncIterator[bytes]:
        """The body, counted onto `offset`: the chunk that would cross the limit is never
        passed on, so a session holds at most `max_blob_bytes` bytes."""
        size = offset
        async for chunk in body:
            size += len(chunk)
            if 0 < self.max_blob_bytes < size:
                raise _BlobTooLarge
            yield chunk

    async def _hasher(self, repo: str, upload_id: str, offset: int) -> Hasher:
        """A hasher over the session's first `offset` bytes, from cache or by rehashing."""
        hasher = self._hashers.get(upload_id)
        if hasher is None or hasher.size > offset:
            hasher = Hasher()
        if hasher.size < offset:
            key = paths.upload_data(repo, upload_id)
            async for piece in self.store.read(key, hasher.size, offset - hasher.size):
                hasher.update(piece)
        self._hashers[upload_id] = hasher
        return hasher

    async def finish(
        self, repo: str, upload_id: str, digest: Digest, body: AsyncIterable[bytes] | None
    ) -> None:
        """Take an optional last chunk, verify the digest, publish the blob and link it.

        A mismatch is DIGEST_INVALID and publishes nothing; the session is dropped.
        """
        await self._require(repo, upload_id)
        async with self._lock(upload_id):
            offset = await self.offset(repo, upload_id)
            if body is not None:
                await self._receive(repo, upload_id, offset, body)
                offset = await self.offset(repo, upload_id)
            actual = (await self._hasher(repo, upload_id, offset)).digest()
            if actual != digest:
                await self._drop(repo, upload_id)
                raise _digest_mismatch(digest, actual)
            if offset == 0 and await self.store.stat(paths.upload_data(repo, upload_id)) is None:
                # An empty blob: no chunk ever created the staged object, so publish an empty one.
                await self.store.put(paths.upload_data(repo, upload_id), b"")
            # Publish even when the bytes exist: the fresh copy's mtime keeps gc's grace period
            # from sweeping a blob this upload is about to link.
            await self.store.commit(paths.blob(digest), paths.upload_data(repo, upload_id))
            await self.blobs.link(repo, digest)
            await self._drop(repo, upload_id)

    async def monolithic(self, repo: str, digest: Digest, body: AsyncIterable[bytes]) -> None:
        """A whole blob in one request (`POST ?digest=` with a body): no session objects at
        all, the bytes go straight to a staged key beside the blob, hashed as they are written,
        and are published only if they match `digest` (else DIGEST_INVALID, nothing kept).
        Nothing here is resumable, so nothing is kept for a resume: a failure removes the
        staged key (and a crash leaves only it, which gc sweeps)."""
        staged = paths.staging(paths.blob(digest), uuid.uuid4().hex)
        hasher = Hasher()
        try:
            try:
                await self.store.append(staged, self._within_limit(_nonempty(body), 0),
                                        observe=hasher.update)
            except _BlobTooLarge:
                raise self._too_large() from None
            actual = hasher.digest()
            if actual != digest:
                raise _digest_mismatch(digest, actual)
            if hasher.size == 0 and await self.store.stat(staged) is None:
                await self.store.put(staged, b"")  # no chunk created it: an empty blob
            await self.store.commit(paths.blob(digest), staged)
        except BaseException:
            await asyncio.shield(self.store.delete(staged))
            raise
        await self.blobs.link(repo, digest)

    # -- housekeeping --------------------------------------------------------------------------

    async def purge_stale(self, now: float | None = None) -> list[str]:
        """Remove sessions started more than `ttl` seconds ago; return their ids."""
        now = time.time() if now is None else now
        removed: list[str] = []
        for repo in await list_repositories(self.store):
            for upload_id in await self.store.list(paths.uploads_dir(repo)):
                if now - await self._started(repo, upload_id) > self.ttl:
                    await self._drop(repo, upload_id)
                    removed.append(upload_id)
        return removed

    async def _started(self, repo: str, upload_id: str) -> float:
        stat = await self.store.stat(paths.upload_session(repo, upload_id))
        if stat is None:  # a half-created or foreign directory: age it by its data, if any
            data = await self.store.stat(paths.upload_data(repo, upload_id))
            return data.mtime if data else 0.0
        try:
            record = json.loads(await self.store.get(paths.upload_session(repo, upload_id)))
            return float(record["started"])
        except (ValueError, KeyError, TypeError):
            return stat.mtime


class _BlobTooLarge(Exception):
    """Raised inside the body stream, so the store stops appending; mapped to 413 above."""


async def _nonempty(body: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    async for chunk in body:
        if chunk:
            yield chunk


def _digest_mismatch(expected: Digest, actual: Digest) -> RegistryError:
    return RegistryError("DIGEST_INVALID",
                         f'digest mismatch, expected "{expected}", got "{actual}"',
                         detail={"expected": str(expected), "actual": str(actual)})
