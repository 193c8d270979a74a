"""Upload sessions: a file sent before its digest is known, readable while it arrives.

`ferry create` streams each safetensors file to the model server while hashing it, instead of
hashing it in a pass of its own first, and starts the create at once, naming the file by its
session (`upload:<id>`). The server reads a shard's header and quantizes its tensors as their
bytes land, so the session is also the meeting point of two threads: the request that writes
the bytes (`append` through its `BlobWriter`) and the create that waits for a byte range
(`wait_for`) and, before it publishes anything, for the verified digest (`wait_verified`).

A session's bytes go to a temp file in `blobs/` reserved at the declared size (so MLX can map
it while it fills). The client names the digest when the body is complete; only if the server's
own hash of the bytes equals it does the file become that blob, else it is removed.

Verified is not yet durable. A safetensors file is never a layer of the model made from it
(create writes one blob per tensor), so a create needs its sources verified, not on disk: while
creates read a session (`acquire` .. `release`), its bytes are not flushed, and the fsync and
rename to the digest name wait until the last reader released it, then run on a thread of
their own, after the create published. Until then the file keeps its temp name (a digest-named
file is always durable); a session no create reads is made durable in the request that commits
it, so its blob is in the store when the client hears 201. A session
that fails (a mismatch, a disconnect, no bytes for `stall_seconds`) removes its temp file, and
every create waiting on it fails. The server never reads a path the client names: a session is
identified by a random id the server chose, and its bytes are only those the client sent.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import Protocol

from registry.blob_writer import BlobWriter, reserve_temp
from registry.digests import Digest
from registry.errors import FerryError, TooLarge

log = logging.getLogger("ferry.uploads")

UPLOAD_REF_PREFIX = "upload:"
MAX_OPEN_UPLOADS = 1024  # a create names at most max_create_files (1024) files
_POLL_SECONDS = 0.2


class UploadFailed(FerryError):
    """The upload a reader waits for failed, stalled or was abandoned (a 400)."""


class Cancel(Protocol):
    def is_set(self) -> bool: ...


class Activity:
    """When bytes last reached any session of a server."""

    def __init__(self) -> None:
        self.last = time.monotonic()


class Upload:
    """One session: `size` bytes expected, `received` so far, then a digest or an error."""

    def __init__(self, upload_id: str, size: int, blobs_dir: Path, stall_seconds: float,
                 server: Activity | None = None) -> None:
        self.id = upload_id
        self.server = server or Activity()
        self.size = size
        self.stall_seconds = stall_seconds
        self.received = 0
        self.digest: Digest | None = None
        self.error: str | None = None
        self.busy = False  # a request owns the file (sending or committing it)
        self.stored = False  # durable under its digest name (after `digest` is known)
        self.readers = 0  # creates reading the file: its persisting waits for them
        self._persist_claimed = False  # commit or the last release makes it durable, once
        self.last_activity = time.monotonic()
        self._cond = threading.Condition()
        self._blobs_dir = blobs_dir
        self._writer: BlobWriter | None = None  # open only while a request sends the bytes
        try:
            self.path = reserve_temp(blobs_dir, size)  # a create links it into its staging dir
        except OSError as exc:  # e.g. larger than the filesystem allows
            raise UploadFailed(f"cannot hold {size} bytes: {exc.strerror}") from None
        self._file = self.path  # the temp file, then (`stored`) the blob

    @property
    def finished(self) -> bool:
        return self.digest is not None or self.error is not None

    def _written(self, total: int) -> None:
        with self._cond:
            self.received = total
            self.last_activity = self.server.last = time.monotonic()
            self._cond.notify_all()
            if self.error is not None:  # failed meanwhile (a stall): stop the request
                raise UploadFailed(f"upload {self.id} failed: {self.error}")

    async def receive(self, stream: AsyncIterable[bytes]) -> None:
        """The body of the one request that sends the bytes; fails the session on any error."""
        with self._cond:
            if self.busy or self.finished or self._writer is not None:
                raise UploadFailed(f"upload {self.id} already received its bytes")
            self.busy = True
        try:
            self._writer = BlobWriter(self._blobs_dir, expected_size=self.size,
                                      on_written=self._written, reserved=self.path,
                                      sync_early=False)
            await self._writer.receive(_at_most(stream, self.size))
        except BaseException as exc:
            self.fail(_reason(exc))
            raise
        finally:
            with self._cond:
                self.busy = False
        if self.received != self.size:
            self.fail(f"got {self.received} of {self.size} bytes")
            raise UploadFailed(f"upload {self.id}: got {self.received} of {self.size} bytes")

    def commit(self, digest: Digest) -> Digest:
        """Verify the bytes against the digest the client computed; they become that blob now
        if no create reads them, else once the last one released them (in the background)."""
        with self._cond:
            if (self.busy or self._writer is None or self.received != self.size
                    or self.finished):
                raise UploadFailed(f"upload {self.id} is not complete"
                                   + (f": {self.error}" if self.error else ""))
            self.busy = True
        try:
            actual = self._writer.verify(digest)  # removes the temp file if it raises
        except BaseException as exc:
            with self._cond:
                self.busy = False
            self.fail(_reason(exc))
            raise
        with self._cond:
            self.busy = False
            self.digest = actual
            self._cond.notify_all()
            now = self.readers == 0 and self._claim_persist()
        if now:
            self._persist(reraise=True)  # the client hears that its blob could not be stored
        return actual

    def acquire(self) -> None:
        """A create reads this session's file: its fsync waits until `release()`."""
        with self._cond:
            self.readers += 1

    def release(self) -> None:
        """A create is done with the file; the last one out starts its persisting (a thread)."""
        with self._cond:
            self.readers -= 1
            start = self.readers == 0 and self.digest is not None and self._claim_persist()
        if start:
            threading.Thread(target=self._persist, daemon=True,
                             name=f"ferry-upload-persist-{self.id[:8]}").start()

    def _claim_persist(self) -> bool:
        """Under the lock: True for the one caller that must persist the verified file."""
        if self._persist_claimed or self.error is not None:
            return False
        self._persist_claimed = True
        return True

    def _persist(self, reraise: bool = False) -> None:
        assert self._writer is not None
        try:
            self._writer.persist(self._renamed)
        except Exception as exc:  # the temp file is gone; the blob is simply not stored
            log.warning("upload %s: verified, but not stored: %s", self.id, _reason(exc))
            with self._cond:
                self.error = f"could not store the upload: {_reason(exc)}"
                self._cond.notify_all()
            if reraise:
                raise

    def _renamed(self, rename: Callable[[], Path]) -> Path:
        with self._cond:  # `link` sees the file under exactly one of its names
            final = rename()
            self._file, self.stored = final, True
            self._cond.notify_all()
        return final

    def link(self, target: Path) -> None:
        """Hard-link the session's file (its temp file, or its blob once stored) at `target`."""
        with self._cond:
            if self.error is not None:
                raise UploadFailed(f"the upload failed: {self.error}")
            os.link(self._file, target)

    def wait_stored(self, timeout: float) -> bool:
        """True once the verified bytes are a durable blob (tests; a drain on shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.stored or self.error is not None, timeout) \
                and self.stored

    def fail(self, reason: str) -> None:
        """Mark the session failed and remove its temp file (a reader's link keeps its inode);
        while a request still writes it, that request removes the file when it stops."""
        with self._cond:
            if self.finished:
                return
            self.error = reason
            self._cond.notify_all()
            busy = self.busy
        if busy:
            return
        if self._writer is not None:
            self._writer.abort()
        else:
            self.path.unlink(missing_ok=True)

    def idle_for(self, now: float) -> float:
        """Seconds without progress. A session not yet sent waits its turn behind the client's
        other files (sent one at a time): while bytes reach any session, it is not idle."""
        if self._writer is not None or self.finished:
            return now - self.last_activity
        return now - max(self.last_activity, self.server.last)

    def wait_for(self, end: int, cancel: Cancel) -> None:
        """Block until the first `end` bytes are in the file; raises if the session fails,
        stalls for `stall_seconds`, or the waiter is cancelled."""
        self._wait(lambda: self.received >= end or self.digest is not None, cancel)

    def wait_verified(self, cancel: Cancel) -> Digest:
        """Block until the client's digest matched the bytes; the blob is then in the store."""
        self._wait(lambda: self.digest is not None, cancel)
        assert self.digest is not None
        return self.digest

    def _wait(self, ready: Callable[[], bool], cancel: Cancel) -> None:
        with self._cond:
            while not ready():
                if self.error is not None:
                    raise UploadFailed(f"the upload failed: {self.error}")
                if cancel.is_set():
                    raise UploadFailed("cancelled while waiting for the upload")
                if self.idle_for(time.monotonic()) > self.stall_seconds:
                    break
                self._cond.wait(_POLL_SECONDS)
            else:
                return
        self.fail(f"no bytes arrived for {self.stall_seconds:g} s")
        raise UploadFailed(f"the upload failed: {self.error}")


class Uploads:
    """The server's open sessions by id (in process: a create reads what this server holds)."""

    def __init__(self, blobs_dir: Path, stall_seconds: float,
                 max_open: int = MAX_OPEN_UPLOADS) -> None:
        self.blobs_dir = blobs_dir
        self.stall_seconds = stall_seconds
        self.max_open = max_open
        self.activity = Activity()
        self._sessions: dict[str, Upload] = {}
        self._lock = threading.Lock()

    def start(self, size: int) -> Upload:
        """A new session for `size` bytes; abandoned ones are swept first. The file is reserved
        sparse, so a declared size the disk cannot hold (beside what open sessions still
        expect) is refused here, with a 413, not after gigabytes arrived."""
        self.sweep()
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.blobs_dir).free
        with self._lock:
            open_sessions = [u for u in self._sessions.values() if not u.finished]
            if len(open_sessions) >= self.max_open:
                raise UploadFailed(f"too many open uploads (at most {self.max_open})")
            expected = sum(u.size - u.received for u in open_sessions)
            if size > free - expected:
                raise TooLarge("the upload", max(free - expected, 0), size)
            upload = Upload(secrets.token_hex(16), size, self.blobs_dir, self.stall_seconds,
                            self.activity)
            self._sessions[upload.id] = upload
        return upload

    def get(self, upload_id: str) -> Upload | None:
        with self._lock:
            return self._sessions.get(upload_id)

    def sweep(self, now: float | None = None) -> None:
        """Forget finished sessions and fail those idle past the stall limit (their temp files
        go); a session still receiving is left to its request, which fails it on its own."""
        now = time.monotonic() if now is None else now
        with self._lock:
            sessions = list(self._sessions.values())
        for upload in sessions:
            idle = upload.idle_for(now) > self.stall_seconds
            if not upload.finished and idle and not upload.busy:
                upload.fail(f"no bytes arrived for {self.stall_seconds:g} s")
            if upload.finished and (upload.error or idle):
                with self._lock:
                    self._sessions.pop(upload.id, None)


def parse_upload_ref(value: str) -> str | None:
    """The session id of an `upload:<id>` reference, else None."""
    if isinstance(value, str) and value.startswith(UPLOAD_REF_PREFIX):
        return value[len(UPLOAD_REF_PREFIX):]
    return None


async def _at_most(stream: AsyncIterable[bytes], size: int) -> AsyncIterable[bytes]:
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > size:
            raise UploadFailed(f"the body is longer than the declared {size} bytes")
        yield chunk


def _reason(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        return message
    return type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
