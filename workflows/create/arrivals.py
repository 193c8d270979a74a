"""The files of a create that are still arriving: wait for a byte range, then for the digest.

`ferry create` starts the create while it uploads the checkpoint's safetensors files (each an
upload session, `registry.upload_sessions`). The staged dir links each session's temp file,
reserved at its full size, so the inventory and MLX can open it at once; every read of a staged
file first asks `wait(path, end)` for the bytes it needs (a shard's header, one tensor's range),
and the plan is written in the order the bytes arrive. Before anything is published,
`wait_verified()` blocks until every session's bytes matched the digest the client computed: a
mismatch, a disconnect or a stall fails the create, which then publishes no manifest.
The create holds each session (`Upload.acquire`) until `release()`, after it published: the
uploaded files are sources, never layers, so their fsync waits until then, off the create's path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from registry.digests import Digest
from registry.upload_sessions import Upload, UploadFailed
from workflows.create.errors import CreateCancelled, CreateError
from workflows.create.write import CancelSignal


class Arrivals:
    """Pending files by relative path; `attach(root)` once they are linked under `root`."""

    def __init__(self, pending: Mapping[str, Upload], cancel: CancelSignal) -> None:
        self.pending = dict(pending)
        self.cancel = cancel
        self._by_path: dict[Path, tuple[str, Upload]] = {}
        self._rank = {rel: i for i, rel in enumerate(sorted(self.pending))}
        for upload in self.pending.values():
            upload.acquire()

    def release(self) -> None:
        """The create is over (published or failed): the sessions may become durable blobs."""
        uploads, self.pending = list(self.pending.values()), {}
        for upload in uploads:
            upload.release()

    def attach(self, root: Path) -> None:
        self._by_path = {root / rel: (rel, up) for rel, up in self.pending.items()}

    def wait(self, path: Path, end: int) -> None:
        """Return once the first `end` bytes of `path` are on disk (at once for a stored blob)."""
        entry = self._by_path.get(path)
        if entry is None:
            return
        rel, upload = entry
        try:
            upload.wait_for(end, self.cancel)
        except UploadFailed as exc:
            self._raise(rel, exc)

    def rank(self, path: Path) -> int:
        """The order the client sends pending files in (sorted paths); -1 for stored blobs."""
        entry = self._by_path.get(path)
        return -1 if entry is None else self._rank[entry[0]]

    def wait_verified(self) -> dict[str, Digest]:
        """Every pending file's verified digest; raises if any upload failed."""
        digests = {}
        for rel, upload in self.pending.items():
            try:
                digests[rel] = upload.wait_verified(self.cancel)
            except UploadFailed as exc:
                self._raise(rel, exc)
        return digests

    def _raise(self, rel: str, exc: UploadFailed) -> None:
        if self.cancel.is_set():
            raise CreateCancelled("create cancelled") from exc
        raise CreateError(exc.message, rel) from exc


def link_upload(upload: Upload, target: Path, cancel: CancelSignal) -> None:
    """Link a session's file at `target`: its temp file, or its blob once stored."""
    try:
        upload.link(target)
    except UploadFailed as exc:
        if cancel.is_set():
            raise CreateCancelled("create cancelled") from exc
        raise CreateError(exc.message) from exc
