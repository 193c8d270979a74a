"""A blob being pulled: `blobs/sha256-<hex>-partial` plus one state file per part (reference 1.6).

    blobs/sha256-<hex>-partial      the data, pre-sized; each part writes at its own offset
    blobs/sha256-<hex>-partial-<N>  {"N", "Offset", "Size", "Completed"} of part N

A part's state is saved only after its bytes were written, so it never claims bytes that are not
in the file; after a crash a part re-fetches at most what arrived since its last checkpoint. The
`OrderedHasher` hashes the file front to back while the parts fill it, so verification costs no
second pass; the blob takes its final name only when size and sha256 match.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from registry.digests import Digest, Hasher
from registry.manifests import Descriptor

_HASH_READ = 4 * 1024 * 1024
_FLUSH_EVERY = 16 * 1024 * 1024
_IOV_MAX = 1024


@dataclass
class Part:
    n: int
    offset: int
    size: int
    completed: int = 0

    @property
    def remaining(self) -> int:
        return self.size - self.completed

    @property
    def next_byte(self) -> int:
        return self.offset + self.completed

    def to_json(self) -> bytes:
        return json.dumps({"N": self.n, "Offset": self.offset, "Size": self.size,
                           "Completed": self.completed}).encode()


def plan_parts(total: int, part_size: int) -> list[Part]:
    """Parts of `part_size` (the last takes the remainder); a zero-byte blob has one empty part."""
    if total == 0:
        return [Part(0, 0, 0)]
    return [Part(i, offset, min(part_size, total - offset))
            for i, offset in enumerate(range(0, total, part_size))]


class PartialBlob:
    """The partial data file and its part states for one descriptor."""

    def __init__(self, blobs_dir: Path, desc: Descriptor) -> None:
        self.desc = desc
        self.path = blobs_dir / f"{desc.digest.filename}-partial"
        self.fd: int | None = None

    def state_path(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}-{n}")

    def load_parts(self, part_size: int) -> list[Part]:
        """Saved parts when they describe this blob consistently, else a fresh plan."""
        saved = self._saved_parts()
        if saved and self.path.exists() and _covers(saved, self.desc.size):
            return saved
        self.remove()
        return plan_parts(self.desc.size, part_size)

    def _saved_parts(self) -> list[Part]:
        parts = []
        for path in self.path.parent.glob(f"{self.path.name}-*"):
            try:
                data = json.loads(path.read_bytes())
                part = Part(int(data["N"]), int(data["Offset"]), int(data["Size"]),
                            int(data["Completed"]))
            except (OSError, ValueError, KeyError, TypeError):
                return []
            if not 0 <= part.completed <= part.size:
                return []
            parts.append(part)
        return sorted(parts, key=lambda p: p.n)

    def open(self, parts: list[Part]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(self.fd).st_size != self.desc.size:
            os.ftruncate(self.fd, self.desc.size)
        for part in parts:
            self.save(part)

    def write(self, chunks: list[bytes] | list[memoryview] | list[bytes | memoryview],
              position: int) -> None:
        """Write `chunks` back to back at `position` (one pwritev; short writes resumed)."""
        assert self.fd is not None
        views = [memoryview(c) for c in chunks if c]
        while views:
            written = os.pwritev(self.fd, views[:_IOV_MAX], position)
            position += written
            while views and written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            if written:
                views[0] = views[0][written:]

    def save(self, part: Part) -> None:
        """Persist a part's progress (temp + rename, so a crash never leaves half a state)."""
        path = self.state_path(part.n)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_bytes(part.to_json())
        os.replace(tmp, path)

    def finish(self) -> None:
        """fsync the data and drop the part states; the caller then publishes the file."""
        self.close()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for path in self.path.parent.glob(f"{self.path.name}-*"):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def remove(self) -> None:
        """Drop data and states (a mismatch: the bytes are wrong, start over next time)."""
        self.close()
        self.path.unlink(missing_ok=True)
        for path in self.path.parent.glob(f"{self.path.name}-*"):
            path.unlink(missing_ok=True)


def _covers(parts: list[Part], total: int) -> bool:
    expected = 0
    for i, part in enumerate(parts):
        if part.n != i or part.offset != expected:
            return False
        expected += part.size
    return expected == total


class OrderedHasher:
    """Hashes the partial file from the front as the parts fill it, in a thread of its own.

    The download loop calls `wake()` after each write; `run()` reads whatever contiguous prefix
    is complete (from the page cache) and stops when the whole blob is hashed or `stop()` is
    called. sha256 releases the GIL, so hashing overlaps the network; so does flushing.
    """

    def __init__(self, path: Path, parts: list[Part], total: int) -> None:
        self.path = path
        self.parts = parts
        self.total = total
        self._event = threading.Event()
        self._stopped = False

    def available(self) -> int:
        done = 0
        for part in self.parts:
            done = part.offset + part.completed
            if part.remaining:
                break
        return done

    def wake(self) -> None:
        self._event.set()

    def stop(self) -> None:
        self._stopped = True
        self._event.set()

    def run(self) -> tuple[Digest, int] | None:
        """The digest and size of the whole file, or None when stopped first."""
        with open(self.path, "rb", buffering=0) as fh, \
                ThreadPoolExecutor(1, thread_name_prefix="ferry-flush") as flusher:
            return self._hash(fh.fileno(), flusher)

    def _hash(self, fd: int, flusher: ThreadPoolExecutor) -> tuple[Digest, int] | None:
        hasher = Hasher()
        flushed = 0
        flushing: Future[None] | None = None
        while hasher.size < self.total:
            if hasher.size - flushed >= _FLUSH_EVERY and (flushing is None or flushing.done()):
                # Push hashed bytes to disk as we go, on a thread of its own, so the fsync
                # before the rename does not write the whole blob at the end and the disk
                # works while this thread hashes (their sum would bound the pull, not the max).
                flushing = flusher.submit(os.fdatasync, fd)
                flushed = hasher.size
            if self._stopped:
                return None
            ready = self.available() - hasher.size
            if ready <= 0:
                self._event.wait(0.05)
                self._event.clear()
                continue
            chunk = os.pread(fd, min(ready, _HASH_READ), hasher.size)
            if not chunk:
                return None
            hasher.update(chunk)
        return hasher.digest(), hasher.size
