"""Upload sessions: bytes readable as they land, verified before they become a blob."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator

import pytest

from registry.digests import Digest
from registry.errors import DigestMismatch
from registry.upload_sessions import UploadFailed, Uploads


async def _body(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _digest(data: bytes) -> Digest:
    return Digest.parse("sha256:" + hashlib.sha256(data).hexdigest())


def test_a_session_is_readable_at_full_size_and_becomes_its_blob(tmp_path):
    uploads = Uploads(tmp_path, stall_seconds=30)
    data = b"x" * 5_000_000 + b"y" * 3_000_000
    upload = uploads.start(len(data))
    assert upload.path.stat().st_size == len(data)  # reserved: MLX may map it at once
    asyncio.run(upload.receive(_body(data[:5_000_000], data[5_000_000:])))
    upload.wait_for(len(data), threading.Event())
    assert upload.commit(_digest(data)) == _digest(data)
    assert (tmp_path / _digest(data).filename).read_bytes() == data
    assert not upload.path.exists() and sorted(tmp_path.iterdir()) == [
        tmp_path / _digest(data).filename]


def test_a_wrong_digest_or_a_short_body_leaves_nothing(tmp_path):
    uploads = Uploads(tmp_path, stall_seconds=30)
    upload = uploads.start(4)
    asyncio.run(upload.receive(_body(b"abcd")))
    with pytest.raises(DigestMismatch):
        upload.commit(_digest(b"abce"))
    with pytest.raises(UploadFailed, match="mismatch"):
        upload.wait_verified(threading.Event())
    short = uploads.start(4)
    with pytest.raises(UploadFailed, match="got 2 of 4 bytes"):
        asyncio.run(short.receive(_body(b"ab")))
    with pytest.raises(UploadFailed, match="not complete"):
        short.commit(_digest(b"ab"))
    assert list(tmp_path.iterdir()) == []


def test_abandoned_sessions_are_swept_and_only_open_ones_count(tmp_path):
    uploads = Uploads(tmp_path, stall_seconds=0.05, max_open=1)
    done = uploads.start(0)
    asyncio.run(done.receive(_body()))
    done.commit(_digest(b""))
    idle = uploads.start(10)  # the committed session no longer counts toward max_open
    with pytest.raises(UploadFailed, match="too many open uploads"):
        uploads.start(10)
    with pytest.raises(UploadFailed, match="no bytes arrived"):
        idle.wait_for(1, threading.Event())
    assert not idle.path.exists()
    uploads.sweep()
    assert uploads.get(idle.id) is None
    with pytest.raises(UploadFailed, match="cancelled"):
        uploads.start(10).wait_for(1, _Set())


class _Set:
    def is_set(self) -> bool:
        return True


def test_a_session_waiting_its_turn_is_not_stalled_while_another_receives(tmp_path):
    """The CLI sends its files one after another: the last one's session sits unsent while
    the others arrive, for longer than the stall limit, and must survive that."""
    uploads = Uploads(tmp_path, stall_seconds=0.3)
    first, queued = uploads.start(8 << 22), uploads.start(10)

    async def slow() -> AsyncIterator[bytes]:
        for _ in range(8):
            await asyncio.sleep(0.1)  # 0.8 s in all, each piece one write
            yield b"z" * (4 << 20)

    asyncio.run(first.receive(slow()))
    uploads.sweep()
    assert queued.error is None and uploads.get(queued.id) is queued
    with pytest.raises(UploadFailed, match="no bytes arrived"):
        queued.wait_for(1, threading.Event())  # nothing arrives anywhere any more
