"""Many tensor blobs, written durably without paying one fsync per blob in the critical path.

Each blob is hashed while it is written to a temp file in `blobs/`; its fsync runs on a
background thread while the next tensor is quantized; when the batch closes, every blob whose
fsync succeeded is renamed to its digest name and `blobs/` is fsynced once. So a digest-named
file is always complete and durable (a crash leaves only temp files, which prune sweeps), and
blobs written before a cancel or an error still become blobs, for a retry to reuse.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from registry.digests import Digest, Hasher
from registry.store import TMP_PREFIX, Store, fsync_dir


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobBatch:
    """Use as a context manager; `write()` returns the digest and size of each blob."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferry-fsync")
        self._pending: list[tuple[Future[None], Path, Digest]] = []
        store.blobs_dir.mkdir(parents=True, exist_ok=True)

    def write(self, chunks: Iterable[bytes | memoryview]) -> tuple[Digest, int]:
        tmp = self.store.blobs_dir / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        hasher = Hasher()
        try:
            with open(tmp, "wb") as fh:
                for chunk in chunks:
                    hasher.update(chunk)
                    fh.write(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        digest = hasher.digest()
        self._pending.append((self._pool.submit(_fsync, tmp), tmp, digest))
        return digest, hasher.size

    def close(self) -> None:
        """Publish every blob that reached the disk; drop the rest."""
        try:
            for future, tmp, digest in self._pending:
                try:
                    future.result()
                except OSError:
                    tmp.unlink(missing_ok=True)
                    continue
                self.store.publish_blob(tmp, digest, sync_dir=False)
            fsync_dir(self.store.blobs_dir)
        finally:
            for _, tmp, _ in self._pending:
                tmp.unlink(missing_ok=True)  # only ever a temp name: published ones are gone
            self._pending.clear()
            self._pool.shutdown(wait=True)

    def __enter__(self) -> BlobBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
