"""How bytes become a blob in the local store: two ways in, nothing else.

1. `BlobWriter` (through `Store.blob_writer()`): stream bytes in, hashing as they arrive; `commit()`
   verifies size and sha256 against what the caller expects, fsyncs, and publishes under the
   digest name. Every writer that does not already hold a verified file uses it: an upload to
   `/api/blobs` (`write_stream`), a small pulled blob and a create's JSON or file layers
   (`write_all`), a GGUF concatenation (`write` piece by piece, then `commit`).
2. `adopt_blob` (through `Store.adopt_blob()`): give a file that the caller has already hashed
   and fsynced in `blobs/` its digest name. Used by a pull's partial file (verified by its
   `OrderedHasher` as the parts land) and by create's `BlobBatch` (hashed while written).

Either way the file is written under a temp name in `blobs/` first, so a digest-named file is
always complete; a crash leaves only temp names, which `Store.prune()` sweeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import time
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from registry.digests import Digest, Hasher
from registry.errors import DigestMismatch, SizeMismatch

TMP_PREFIX = ".tmp-"
_FLUSH_BYTES = 4 * 1024 * 1024
# A large blob is pushed to disk as it arrives (on a thread of its own, never blocking writes),
# so the fsync in `commit()` finds little left to write: an upload's durability then overlaps
# its transfer instead of following it.
_SYNC_EVERY = 64 * 1024 * 1024


def fsync_dir(path: Path) -> None:
    """Persist a rename: fsync the directory that holds the entry (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temp_path(directory: Path) -> Path:
    """A fresh temp name in `directory` (never a valid digest name, so never mistaken for one)."""
    return directory / f"{TMP_PREFIX}{secrets.token_hex(8)}"


def adopt_blob(blobs_dir: Path, path: Path, digest: Digest, sync_dir: bool = True) -> Path:
    """Publish a file in `blobs_dir` the caller has verified and fsynced as blob `digest`.

    A same-content blob may already exist; the rename replaces it atomically. `sync_dir=False`
    lets a caller publishing many blobs fsync `blobs/` once at the end.
    """
    final = blobs_dir / digest.filename
    os.chmod(path, 0o644)
    os.replace(path, final)
    if sync_dir:
        fsync_dir(blobs_dir)
    now = time.time()
    os.utime(final, (now, now))
    return final


def reserve_temp(blobs_dir: Path, size: int) -> Path:
    """A new temp file in `blobs_dir`, `size` bytes long (sparse) before its bytes arrive, so a
    reader may map the whole file while it fills (create quantizes an upload as it streams in);
    `BlobWriter(..., reserved=path)` fills it."""
    blobs_dir.mkdir(parents=True, exist_ok=True)
    path = temp_path(blobs_dir)
    try:
        with open(path, "xb") as fh:
            fh.truncate(size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


class BlobWriter:
    """Stream bytes into a temp file in `blobs/`, hashing as they arrive; publish on commit.

    Use as a context manager (or through `write_all` / `write_stream`, which are): leaving the
    block without `commit()` (an error, a cancel, a disconnect) removes the temp file, so nothing
    half-written ever takes a blob's name.
    """

    def __init__(self, blobs_dir: Path, expected: Digest | None = None,
                 expected_size: int | None = None,
                 on_written: Callable[[int], None] | None = None,
                 reserved: Path | None = None, sync_early: bool = True) -> None:
        """`reserved`: a temp file in `blobs_dir` made by `reserve_temp`, written from its start
        without shrinking it (readers may already hold it at its full size). `sync_early=False`:
        no flushing to disk while the bytes arrive (an upload session, whose durability is
        wanted only after the create that reads it, see `verify` and `persist`)."""
        self.blobs_dir = blobs_dir
        self.expected = expected
        self.expected_size = expected_size
        self.hasher = Hasher()
        blobs_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_path = reserved or temp_path(blobs_dir)
        # Closed in commit/abort.
        self._fh = open(self.tmp_path, "r+b" if reserved else "wb")  # noqa: SIM115
        self._done = False
        self._synced = 0
        self._syncer: ThreadPoolExecutor | None = None
        self._syncing: Future[None] | None = None
        self._on_written = on_written
        self._sync_early = sync_early
        self.verified: Digest | None = None

    @property
    def done(self) -> bool:
        """True once the blob was published or its temp file removed."""
        return self._done

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        self.write_chunks((chunk,))

    def write_chunks(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        """Write pieces in order (as received: no copy into one buffer first)."""
        for chunk in chunks:
            self.hasher.update(chunk)
            self._fh.write(chunk)
        if self._sync_early and self.hasher.size - self._synced >= _SYNC_EVERY:
            self._sync_in_background()
        if self._on_written is not None:  # someone reads the temp file as it fills
            self._fh.flush()
            self._on_written(self.hasher.size)

    def _sync_in_background(self) -> None:
        if self._syncing is not None and not self._syncing.done():
            return  # the previous flush still runs; the next write asks again
        self._fh.flush()
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="ferry-blob-sync")
        self._syncing = self._syncer.submit(os.fdatasync, self._fh.fileno())
        self._synced = self.hasher.size

    def _stop_syncing(self) -> None:
        """Wait for a background flush (it uses the file) before the file is closed."""
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None

    def commit(self, expected: Digest | None = None) -> Digest:
        """Verify size and digest, fsync, and rename to the blob's final name. `expected`, when
        given, is the digest the bytes must have (a client that hashed while sending knows it
        only at the end)."""
        self.verify(expected)
        return self.persist()

    def verify(self, expected: Digest | None = None) -> Digest:
        """Check size and digest without making anything durable; the temp file stays (closed)
        until `persist()`. On a mismatch the temp file is removed and the error raised."""
        if expected is not None:
            self.expected = expected
        try:
            self._fh.flush()
            self._stop_syncing()
            actual = self.hasher.digest()
            if self.expected_size is not None and self.hasher.size != self.expected_size:
                raise SizeMismatch(self.expected_size, self.hasher.size)
            if self.expected is not None and actual != self.expected:
                raise DigestMismatch(str(self.expected), str(actual))
            self.verified = actual
            return actual
        finally:
            if self.verified is None:
                self.abort()

    def persist(self, publish: Callable[[Callable[[], Path]], Path] | None = None) -> Digest:
        """fsync the verified bytes, then give them their digest name (never before: a
        digest-named file is always durable). `publish`, when given, runs the rename (the
        callable it is handed), e.g. under a lock of the caller's."""
        assert self.verified is not None, "persist() needs verify() first"
        digest = self.verified
        try:
            os.fsync(self._fh.fileno())
            self._fh.close()
            rename = functools.partial(adopt_blob, self.blobs_dir, self.tmp_path, digest)
            publish(rename) if publish is not None else rename()
            self._done = True
            return digest
        finally:
            if not self._done:
                self.abort()

    def abort(self) -> None:
        self._stop_syncing()
        if not self._fh.closed:
            self._fh.close()
        self.tmp_path.unlink(missing_ok=True)
        self._done = True

    def write_all(self, data: bytes | Iterable[bytes | memoryview]) -> Digest:
        """Write `data` (bytes, or an iterable of chunks) and commit."""
        with self:
            for chunk in [data] if isinstance(data, bytes | bytearray) else data:
                self.write(chunk)
            return self.commit()

    async def write_stream(self, stream: AsyncIterable[bytes]) -> Digest:
        """Write an async stream off the event loop, then commit."""
        try:
            await self.receive(stream)
            return await asyncio.to_thread(self.commit)
        finally:
            if not self._done:
                await asyncio.to_thread(self.abort)

    async def receive(self, stream: AsyncIterable[bytes]) -> None:
        """Write an async stream off the event loop, without committing; on any failure the
        temp file is removed.

        Double-buffered: while a worker thread hashes and writes one batch (the received pieces
        as they are, not joined: a copy of every byte less on the event loop), the loop receives
        the next, so a fast upload is bounded by the slower of the two, not their sum. Writes
        stay in order because a batch starts only after the previous one finished.
        """
        in_flight: asyncio.Future[None] | None = None
        try:
            pending: list[bytes] = []
            pending_size = 0
            async for chunk in stream:
                pending.append(chunk)
                pending_size += len(chunk)
                if pending_size >= _FLUSH_BYTES:
                    if in_flight is not None:
                        await in_flight
                    in_flight = asyncio.ensure_future(asyncio.to_thread(self.write_chunks,
                                                                        pending))
                    pending, pending_size = [], 0
            if in_flight is not None:
                await in_flight
                in_flight = None
            if pending:
                await asyncio.to_thread(self.write_chunks, pending)
        except BaseException:
            if in_flight is not None:
                # The thread cannot be interrupted: let it finish before the file is removed.
                await asyncio.gather(in_flight, return_exceptions=True)
            if not self._done:
                await asyncio.to_thread(self.abort)
            raise

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()
