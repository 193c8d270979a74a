"""Many tensor blobs, written durably without paying for hashing, writing and one fsync per
blob in the critical path.

A background thread hashes each blob while writing it to a temp file in `blobs/`, while the
caller quantizes the next tensor (at most MAX_IN_FLIGHT blobs wait, so memory stays bounded by a
few tensors); its fsync then runs on a pool of SYNC_THREADS, so the writer never waits for the
disk, and fsyncs that overlap share the filesystem's journal commits. When the batch closes,
every blob that reached the disk is renamed to its digest name and `blobs/` is fsynced once. So a
digest-named file is always complete and durable (a crash leaves only temp files, which prune
sweeps), and blobs written before a cancel or an error still become blobs, for a retry to reuse.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from registry.blob_writer import fsync_dir, temp_path
from registry.digests import Digest, Hasher
from registry.store import Store

MAX_IN_FLIGHT = 4
SYNC_THREADS = 4


class BlobBatch:
    """Use as a context manager; `submit()` returns a future of each blob's (digest, size)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-blobs")
        self._syncer = ThreadPoolExecutor(max_workers=SYNC_THREADS,
                                          thread_name_prefix="ferry-blobs-sync")
        self._futures: list[Future[tuple[Path, Digest, int]]] = []
        self._syncs: list[Future[Path]] = []
        store.blobs_dir.mkdir(parents=True, exist_ok=True)

    def submit(self, chunks: Iterable[bytes | memoryview]) -> Future[tuple[Path, Digest, int]]:
        """Queue one blob; blocks while MAX_IN_FLIGHT earlier ones are still being written."""
        while sum(not f.done() for f in self._futures) >= MAX_IN_FLIGHT:
            wait([f for f in self._futures if not f.done()], return_when=FIRST_COMPLETED)
        future = self._pool.submit(self._write, chunks)
        self._futures.append(future)
        return future

    def _write(self, chunks: Iterable[bytes | memoryview]) -> tuple[Path, Digest, int]:
        tmp = temp_path(self.store.blobs_dir)
        hasher = Hasher()
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    hasher.update(chunk)
                    fh.write(chunk)
            self._syncs.append(self._syncer.submit(_fsync, tmp))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, hasher.digest(), hasher.size

    def close(self) -> None:
        """Publish every blob that reached the disk; the temp files of the rest are gone. A
        blob whose fsync failed never takes its name, and the batch then raises that error:
        the create that wrote it must not publish a manifest naming it."""
        self._pool.shutdown(wait=True)  # every fsync is queued once the writes are done
        self._syncer.shutdown(wait=True)
        synced = {f.result() for f in self._syncs if f.exception() is None}
        failed = next((f.exception() for f in self._syncs if f.exception() is not None), None)
        published = False
        for future in self._futures:
            if future.exception() is not None:
                continue
            tmp, digest, _ = future.result()
            if tmp in synced:
                self.store.adopt_blob(tmp, digest, sync_dir=False)
                published = True
            else:  # its fsync failed: the bytes may not be on disk, so it never takes a name
                tmp.unlink(missing_ok=True)
        if published:
            fsync_dir(self.store.blobs_dir)
        self._futures.clear()
        self._syncs.clear()
        if failed is not None:
            raise failed

    def __enter__(self) -> BlobBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fsync(path: Path) -> Path:
    """fsync a written file by its path (any descriptor of the inode flushes its data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
