"""The create pipeline reading a shard while it is still being written (upload sessions)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from registry import blob_writer
from registry.digests import Digest
from registry.errors import DigestMismatch
from registry.names import Name
from registry.store import Store
from registry.upload_sessions import Uploads
from runner.quant import parse_quant_type
from workflows.create import CreateOptions, UploadedFiles, create
from workflows.create.arrivals import link_upload
from workflows.create.inventory import read_header

from .helpers import upload_dir

SHARD = "model.safetensors"


def test_a_header_is_read_only_once_its_bytes_arrived(tmp_path, wide_checkpoint):
    """Bytes land only when asked for; nothing read earlier (a read-ahead) may be kept."""
    data = (wide_checkpoint / SHARD).read_bytes()
    growing = tmp_path / SHARD
    with open(growing, "wb") as fh:
        fh.truncate(len(data))  # reserved at full size, zeros until written
    asked = []

    def arrive(path: Path, end: int) -> None:
        asked.append(end)
        with open(path, "r+b") as fh:
            fh.write(data[:end])

    def layout(path: Path, wait=None) -> list:
        header = read_header(path, SHARD, wait) if wait else read_header(path, SHARD)
        return [(t.name, t.dtype, t.shape, t.start, t.nbytes) for t in header.values()]

    assert layout(growing, arrive) == layout(wide_checkpoint / SHARD)
    assert asked[0] == 8 and asked[1] > 8  # the length first, then the header, nothing more


def test_create_quantizes_a_shard_as_it_arrives(store, wide_checkpoint):
    """A ~66 MB shard sent in pieces while the create runs gives the model a stored one does."""
    quant = parse_quant_type("int4")
    stored = upload_dir(store, wide_checkpoint)
    create(Name.parse("me/stored"), UploadedFiles({k: Digest.parse(v) for k, v in
                                                   stored.items()}),
           CreateOptions(quantize=quant), store, lambda e: None, threading.Event())
    # Forget the shard's blob so the session has to write it anew.
    store.delete_blob(Digest.parse(stored[SHARD]))
    data = (wide_checkpoint / SHARD).read_bytes()
    uploads = Uploads(store.blobs_dir, stall_seconds=30)
    upload = uploads.start(len(data))
    seen: list[int] = []

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 8 << 20):
            await asyncio.sleep(0.05)
            yield data[i:i + (8 << 20)]

    def send() -> None:
        asyncio.run(upload.receive(pieces()))
        seen.append(upload.received)
        upload.commit(Digest.parse("sha256:" + hashlib.sha256(data).hexdigest()))

    files = {k: Digest.parse(v) for k, v in stored.items() if k != SHARD}
    progress: list[tuple[float, int]] = []
    sender = threading.Thread(target=send)
    sender.start()
    create(Name.parse("me/streamed"), UploadedFiles(files, {SHARD: upload}),
           CreateOptions(quantize=quant), store,
           lambda e: progress.append((time.monotonic(), upload.received)), threading.Event())
    sender.join()
    assert store.read_manifest(Name.parse("me/streamed")) == \
        store.read_manifest(Name.parse("me/stored"))
    # Tensors were written before the whole shard was there.
    assert any(received < len(data) for _, received in progress)
    # The source is made durable after the create, in the background, then named.
    assert upload.wait_stored(30)
    assert store.has_blob(Digest.parse(stored[SHARD]))
    assert sorted(store.blobs_dir.glob(".tmp-*")) == []


def _received(store: Store, data: bytes):
    upload = Uploads(store.blobs_dir, stall_seconds=30).start(len(data))

    async def body() -> AsyncIterator[bytes]:
        yield data

    asyncio.run(upload.receive(body()))
    return upload, Digest.parse("sha256:" + hashlib.sha256(data).hexdigest())


def test_staging_a_session_while_it_is_renamed_links_the_one_file(tmp_path, monkeypatch):
    """Linking and the rename to the blob name exclude each other: the link is always made."""
    store = Store(tmp_path / "models")
    upload, digest = _received(store, b"abcd")
    renamed = threading.Event()
    adopt = blob_writer.adopt_blob

    def slow_adopt(*args, **kwargs):
        path = adopt(*args, **kwargs)
        renamed.set()
        time.sleep(0.3)
        return path

    monkeypatch.setattr(blob_writer, "adopt_blob", slow_adopt)
    commit = threading.Thread(target=upload.commit, args=(digest,))
    commit.start()
    assert renamed.wait(10)
    link_upload(upload, tmp_path / SHARD, threading.Event())
    commit.join()
    assert (tmp_path / SHARD).read_bytes() == b"abcd"
    assert upload.stored and store.has_blob(digest)


def test_a_session_a_create_reads_is_stored_only_after_its_release(tmp_path, monkeypatch):
    """Verified is enough for the create; the fsync and the digest name come after it."""
    store = Store(tmp_path / "models")
    upload, digest = _received(store, b"abcd")
    synced: list[int] = []
    fsync = blob_writer.os.fsync
    monkeypatch.setattr(blob_writer.os, "fsync", lambda fd: (synced.append(fd), fsync(fd)))
    upload.acquire()
    assert upload.commit(digest) == digest and upload.digest == digest
    assert not upload.stored and not store.has_blob(digest) and synced == []
    assert [p.name.startswith(".tmp-") for p in store.blobs_dir.iterdir()] == [True]
    link_upload(upload, tmp_path / SHARD, threading.Event())  # the temp file, for a reader
    upload.release()
    assert upload.wait_stored(30) and store.has_blob(digest) and synced
    assert [p.name for p in store.blobs_dir.iterdir()] == [digest.filename]
    assert (tmp_path / SHARD).read_bytes() == b"abcd"


def test_a_session_no_create_reads_is_stored_when_committed(tmp_path):
    store = Store(tmp_path / "models")
    upload, digest = _received(store, b"abcd")
    upload.commit(digest)
    assert upload.stored and store.has_blob(digest)
    assert sorted(store.blobs_dir.glob(".tmp-*")) == []


def test_a_wrong_digest_removes_a_read_session_at_once(tmp_path):
    store = Store(tmp_path / "models")
    upload, _ = _received(store, b"abcd")
    upload.acquire()
    wrong = Digest.parse("sha256:" + hashlib.sha256(b"abce").hexdigest())
    with pytest.raises(DigestMismatch):
        upload.commit(wrong)
    upload.release()
    assert upload.error is not None and not upload.wait_stored(1)
    assert list(store.blobs_dir.iterdir()) == []


def test_a_failed_fsync_stores_nothing_and_the_committer_hears_it(tmp_path, monkeypatch):
    store = Store(tmp_path / "models")
    upload, digest = _received(store, b"abcd")

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(blob_writer.os, "fsync", broken)
    with pytest.raises(OSError):
        upload.commit(digest)
    assert not upload.stored and upload.error is not None
    assert list(store.blobs_dir.iterdir()) == []
