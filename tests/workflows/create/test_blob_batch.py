"""BlobBatch: a tensor blob takes its digest name only after its own fsync succeeded."""

from __future__ import annotations

import hashlib
import os

import pytest

from registry.digests import Digest
from registry.store import Store
from workflows.create import blob_batch
from workflows.create.blob_batch import BlobBatch


def _digest(data: bytes) -> Digest:
    return Digest.parse("sha256:" + hashlib.sha256(data).hexdigest())


def test_every_blob_is_fsynced_before_it_is_named(tmp_path, monkeypatch):
    store = Store(tmp_path / "models")
    events: list[tuple[str, str]] = []
    fsync, adopt = os.fsync, store.adopt_blob

    def traced_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def traced_adopt(path, digest, sync_dir=True):
        events.append(("named", str(path)))
        return adopt(path, digest, sync_dir=sync_dir)

    monkeypatch.setattr(blob_batch.os, "fsync", traced_fsync)
    monkeypatch.setattr(store, "adopt_blob", traced_adopt)
    data = [b"one" * 1000, b"two" * 2000, b"three"]
    with BlobBatch(store) as batch:
        futures = [batch.submit(iter([d[:7], d[7:]])) for d in data]
        results = [f.result()[1:] for f in futures]
    assert results == [(_digest(d), len(d)) for d in data]
    assert all(store.read_blob(_digest(d)) == d for d in data)
    named = [path for kind, path in events if kind == "named"]
    synced = [path for kind, path in events if kind == "fsync"]
    assert len(named) == 3 and set(named) <= set(synced)
    first_name = events.index(("named", named[0]))
    assert all(events.index(("fsync", p)) < first_name for p in named)


def test_a_blob_whose_fsync_failed_is_not_named_and_leaves_no_temp_file(tmp_path, monkeypatch):
    store = Store(tmp_path / "models")
    calls = []
    fsync = os.fsync

    def failing_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(blob_batch.os, "fsync", failing_once)
    # the error reaches the create (which then publishes no manifest naming the blob)
    with pytest.raises(OSError, match="Input/output error"), BlobBatch(store) as batch:
        batch.submit(iter([b"only"])).result()
    assert list(store.blobs_dir.iterdir()) == []
