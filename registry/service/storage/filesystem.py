"""The filesystem BlobStore: keys are paths under one root directory.

Why some calls block the event loop on purpose: a stat, a 64-byte link read or a rename of a
small file costs a few microseconds on a local disk, far less than a hop to a worker thread, so
those run inline. Everything that moves real data (reads and writes in 1 MiB pieces) or waits on
the disk (fsync) runs on a dedicated thread pool, so the loop keeps serving other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from registry.service.storage.base import STAGING_MARKER, KeyNotFound, Stat, is_staged_leaf

PIECE = 1024 * 1024  # bytes per read or write handed to a worker thread
INLINE_READ = 256 * 1024  # objects up to this size are read on the loop in one call
INLINE_WRITE = 64 * 1024  # a last piece up to this size is written on the loop
# An append keeps taking the stream while a worker writes the previous batch, up to this much
# (then it waits): the request's reader never stops, so its pieces never pile up unread in the
# server (where they were joined by copying). With the batch in flight, an upload holds at most
# about twice this in memory, only while the disk is slower than the network.
PENDING_MAX = 8 * 1024 * 1024
# A long append pushes its bytes to disk as it goes (fdatasync on a worker, never awaited), so
# the fsync in `commit()` finds little left to write, and a reader's own fsync (a client of the
# pull-through cache, on the same disk) does not queue behind a whole blob of dirty pages.
FLUSH_EVERY = 64 * 1024 * 1024


class FilesystemStore:
    def __init__(self, root: Path, workers: int = 32) -> None:
        self.root = Path(root)
        self._executor: ThreadPoolExecutor | None = None
        self._workers = workers

    # -- plumbing ------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid storage key {key!r}")
        return os.path.join(self.root, key)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-fs")
        return self._executor

    async def _offload(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._pool(), fn, *args)

    def close(self) -> None:
        """Stop the worker threads (the app's shutdown calls this)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- the protocol --------------------------------------------------------------------------

    async def stat(self, key: str) -> Stat | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return Stat(size=st.st_size, mtime=st.st_mtime)

    async def read(
        self, key: str, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes | memoryview]:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise KeyNotFound(key) from exc
        try:
            end = os.fstat(fd).st_size if length is None else offset + length
            if end - offset <= INLINE_READ:
                if end > offset:
                    yield os.pread(fd, end - offset, offset)
                return
            position = offset
            while position < end:
                size = min(PIECE, end - position)
                piece = _cached_pread(fd, size, position)
                if piece is None:  # not in the page cache: let a worker wait for the disk
                    piece = await self._offload(os.pread, fd, size, position)
                if not piece:
                    break
                position += len(piece)
                yield piece
        finally:
            os.close(fd)

    async def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                return fh.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise KeyNotFound(key) from exc

    async def get_versioned(self, key: str) -> tuple[bytes, str | None]:
        try:
            data = await self.get(key)
        except KeyNotFound:
            return b"", None
        return data, _version(data)

    async def put_if(self, key: str, data: bytes, expected: str | None) -> bool:
        # flock on the parent directory: held by one open file at a time, so separate processes
        # (and threads) on this disk swap one after another. Nothing awaits while it is held.
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if (await self.get_versioned(key))[1] != expected:
                return False
            await self.put(key, data)
            return True
        finally:
            os.close(fd)  # closing releases the lock

    async def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = f"{path}{STAGING_MARKER}{uuid.uuid4().hex[:12]}"
        try:
            fh = open(tmp, "wb")  # noqa: SIM115 - closed below, retried after makedirs
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fh = open(tmp, "wb")  # noqa: SIM115
        try:
            with fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    async def append(
        self, key: str, chunks: AsyncIterable[bytes | memoryview],
        observe: Callable[[bytes | memoryview], object] | None = None,
    ) -> int:
        """Double-buffered: while a worker hashes (`observe`) and writes one batch, the loop
        receives the next, so a fast upload costs the slower of the two, not their sum (and the
        request's socket keeps being read). One batch at a time, so writes stay in order."""
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        loop = asyncio.get_running_loop()
        written = flushed = 0
        flushing: Future[None] | None = None
        writing: asyncio.Future[int] | None = None
        pending: list[bytes | memoryview] = []
        pending_size = 0
        try:
            async for chunk in chunks:
                pending.append(chunk)
                pending_size += len(chunk)
                if pending_size < PIECE or (
                        writing is not None and not writing.done() and pending_size < PENDING_MAX):
                    continue  # keep receiving while the worker is busy
                if writing is not None:
                    written += await writing
                    writing = None
                writing = loop.run_in_executor(self._pool(), _write_all, fd, pending, observe)
                pending, pending_size = [], 0
                if written - flushed >= FLUSH_EVERY and (flushing is None or flushing.done()):
                    flushing = self._pool().submit(os.fdatasync, fd)
                    flushed = written
        finally:
            # Whatever arrived before a failure is kept, so the session can resume from it.
            last: asyncio.Future[int] | None = None
            try:
                if writing is not None:
                    written += await asyncio.shield(writing)
                if pending_size > INLINE_WRITE:
                    last = loop.run_in_executor(self._pool(), _write_all, fd, pending, observe)
                    written += await asyncio.shield(last)
                elif pending:  # a log line or a tiny last chunk: cheaper than a thread hop
                    written += _write_all(fd, pending, observe)
            finally:
                # A write or flush still running (a cancel interrupted the waits above) uses
                # fd: it is closed when they end (a flush's error, if any, is commit()'s fsync's).
                _close_when_done(fd, [f for f in (writing, last, flushing) if f is not None])
        return written

    async def commit(self, key: str, staged: str) -> None:
        await self._offload(_publish, self._path(staged), self._path(key))

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except (IsADirectoryError, PermissionError):
            shutil.rmtree(path, ignore_errors=True)

    async def list(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(self._path(prefix) if prefix else self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if STAGING_MARKER not in n)

    async def staged(self) -> Sequence[tuple[str, Stat]]:
        return await self._offload(_staged_files, str(self.root))

    def redirect_url(self, key: str) -> str | None:
        return None


def _staged_files(root: str) -> list[tuple[str, Stat]]:
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            if is_staged_leaf(name):
                path = os.path.join(directory, name)
                with contextlib.suppress(FileNotFoundError):  # published meanwhile
                    st = os.stat(path)
                    found.append((os.path.relpath(path, root), Stat(st.st_size, st.st_mtime)))
    return sorted(found)


def _cached_pread(fd: int, size: int, position: int) -> memoryview | None:
    """Read what the page cache already holds, without blocking (RWF_NOWAIT), or None.

    A hot blob is then served with no thread hop per piece: on a busy machine each hop waits
    for the scheduler to wake a worker, which starves the socket. Returns a view of a fresh
    buffer, so the transport may keep it until sent.
    """
    if _NOWAIT is None:
        return None
    buffer = bytearray(size)
    try:
        got = os.preadv(fd, [buffer], position, _NOWAIT)
    except (BlockingIOError, OSError):  # EAGAIN: not cached; EOPNOTSUPP: fs cannot say
        return None
    return memoryview(buffer)[:got] if got else None


_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _close_when_done(fd: int, futures: list[Future[None] | asyncio.Future[int]]) -> None:
    """Close `fd` now, or once the last of `futures` (writes, flushes that use it) is done."""
    running = [f for f in futures if not f.done()]
    if not running:
        os.close(fd)
        return
    left = [len(running)]
    lock = threading.Lock()

    def one_done(_future: object) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            os.close(fd)

    for future in running:
        future.add_done_callback(one_done)  # type: ignore[arg-type]


def _write_all(fd: int, pieces: list[bytes | memoryview],
               observe: Callable[[bytes | memoryview], object] | None) -> int:
    total = 0
    for piece in pieces:
        if observe is not None:
            observe(piece)  # hashlib releases the GIL: hashing runs beside the event loop
        view = memoryview(piece)
        while view:
            n = os.write(fd, view)
            view = view[n:]
            total += n
    return total


def _version(data: bytes) -> str:
    """A content hash: equal bytes, equal version (enough for a compare-and-swap of values)."""
    return hashlib.sha256(data).hexdigest()


def _publish(src: str, dst: str) -> None:
    """fsync the staged file, then rename it into place (same filesystem, so atomic)."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        if not os.path.exists(src):
            raise
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
