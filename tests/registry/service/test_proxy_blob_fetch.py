"""The fan-out of one blob fetch to the requests that share it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from registry.digests import Digest
from registry.service.errors import RegistryError
from registry.service.proxy import blob_fetch
from registry.service.proxy.blob_fetch import QUEUE_PIECES, BlobFetch
from registry.service.proxy.config import ProxyConfig, Upstream
from registry.service.proxy.upstream import UpstreamClient
from registry.service.registry import Registry
from registry.service.storage.filesystem import FilesystemStore


def _fetch(tmp_path: Path) -> BlobFetch:
    upstream = Upstream("", httpx.URL("http://127.0.0.1:9"))
    client = UpstreamClient(upstream, ProxyConfig((upstream,), home=tmp_path))
    registry = Registry.open(FilesystemStore(tmp_path / "root"))
    return BlobFetch(registry, client, "r/x", Digest.of(b"x"), ProxyConfig((upstream,)).retry)


async def test_a_request_that_stops_reading_is_dropped_and_the_others_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blob_fetch, "SUBSCRIBER_STALL", 0.05)
    fetch = _fetch(tmp_path)
    stalled = fetch.subscribe(0, None)
    reading = fetch.subscribe(0, None)
    assert stalled is not None and reading is not None
    received = []

    async def read() -> None:
        while (piece := await reading.next()) is not None:
            received.append(piece)

    reader = asyncio.create_task(read())
    for _ in range(QUEUE_PIECES + 10):
        await fetch._broadcast(b"piece")
    await fetch._finish()
    await asyncio.wait_for(reader, 5)
    assert len(received) == QUEUE_PIECES + 10
    assert stalled.closed and stalled not in fetch.subscribers
    with pytest.raises(RegistryError, match="stopped reading"):
        await stalled.next()
    assert fetch.subscribe(0, None) is None  # its bytes went by: a late request waits instead


async def test_a_request_joining_while_a_piece_is_delivered_gets_it_from_the_replay(
        tmp_path: Path) -> None:
    fetch = _fetch(tmp_path)
    slow = fetch.subscribe(0, None)
    assert slow is not None
    for _ in range(QUEUE_PIECES):
        await fetch._broadcast(b"ab")  # fills the slow request's queue
    offset = 2 * QUEUE_PIECES
    delivering = asyncio.create_task(fetch._broadcast(b"cd"))  # waits on the slow request
    await asyncio.sleep(0.01)
    assert not delivering.done()
    during = fetch.subscribe(offset, None)  # not in this round: "cd" comes from the replay
    after = fetch.subscribe(offset + 2, None)
    assert during is not None and after is not None
    await slow.next()
    await asyncio.wait_for(delivering, 5)
    slow.close()
    await fetch._broadcast(b"ef")
    assert [await during.next(), await during.next()] == [b"cd", b"ef"]
    assert await after.next() == b"ef"


async def test_a_late_request_is_replayed_what_went_by_and_then_follows_live(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blob_fetch, "REPLAY_BYTES", 9)
    fetch = _fetch(tmp_path)
    for piece in (b"0123", b"4567", b"89ab", b"cdef"):
        await fetch._broadcast(piece)  # the replay keeps "4567" "89ab" "cdef": >= 9 bytes
    assert fetch.subscribe(3, None) is None  # gone by for good: it waits for the cache
    late = fetch.subscribe(5, None)
    ranged = fetch.subscribe(6, 9)  # all of it went by, and the replay still has it
    assert late is not None and ranged is not None
    assert [await ranged.next(), await ranged.next(), await ranged.next()] == [b"67", b"89",
                                                                               None]
    assert ranged not in fetch.subscribers
    await fetch._broadcast(b"gh")
    await fetch._finish()
    received = []
    while (piece := await late.next()) is not None:
        received.append(piece)
    assert b"".join(received) == b"56789abcdefgh"
