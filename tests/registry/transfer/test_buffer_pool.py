"""Reused receive buffers (registry/transfer/buffer_pool.py, used by plain_socket's body path):
a buffer comes back only when nobody holds a piece of it, so a kept piece never changes."""

from __future__ import annotations

import asyncio
import hashlib
import os

from registry.transfer import plain_socket
from registry.transfer.buffer_pool import BufferPool
from registry.transfer.session import Reply

from .test_plain_socket import head, read_request, scripted, session

MiB = 1024 * 1024


def test_a_buffer_held_through_a_slice_is_not_handed_out_again() -> None:
    pool = BufferPool(16, limit=4)
    first = pool.take()
    piece = memoryview(first)[2:5]  # what a consumer keeps: a view of part of it
    del first
    second = pool.take()
    assert second is not piece.obj
    del second
    assert pool.take() is not piece.obj  # still held: never reused
    held = id(piece.obj)
    piece.release()
    del piece
    assert len(pool) == 2
    again = [pool.take(), pool.take()]  # let go by every holder: one of these is it
    assert held in {id(b) for b in again}
    assert len(pool) == 2


def test_the_pool_keeps_at_most_its_limit_and_empties_only_when_idle() -> None:
    pool = BufferPool(8, limit=2)
    taken = [pool.take() for _ in range(5)]  # all held: each one is new
    assert len({id(b) for b in taken}) == 5
    assert len(pool) == 2
    pool.enter()
    pool.clear_if_idle()
    assert len(pool) == 2  # a body is being read: keep them
    assert pool.leave()
    pool.clear_if_idle()
    assert len(pool) == 0


async def test_kept_pieces_of_several_bodies_keep_their_bytes() -> None:
    """Every piece of three bodies read one after another is kept (as a cache's replay and
    queues keep them): none is overwritten by a later body reusing its buffer."""
    bodies = [os.urandom(3 * MiB + 123) for _ in range(3)]
    served = iter(bodies)

    async def blobs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            body = next(served)
            writer.write(head(len(body)) + body)
            await writer.drain()

    kept: list[list[memoryview]] = []
    async with scripted(blobs) as (_, base):
        client = session(base)
        try:
            for _ in bodies:
                reply: Reply = await client.send("GET", f"{base}/blob")
                kept.append([piece async for piece in reply.pieces()])
                await reply.aclose()
        finally:
            await client.aclose()
    assert [b"".join(pieces) for pieces in kept] == bodies


async def test_pieces_let_go_as_they_are_used_are_read_into_the_same_few_buffers() -> None:
    body = os.urandom(40 * MiB)

    async def blob(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await read_request(reader):
            writer.write(head(len(body)) + body)
            await writer.drain()

    plain_socket._POOL.clear_if_idle()  # none from an earlier test: count this body's own
    buffers: set[int] = set()
    hasher = hashlib.sha256()
    async with scripted(blob) as (_, base):
        client = session(base)
        try:
            reply = await client.send("GET", f"{base}/blob")
            async for piece in reply.pieces():
                hasher.update(piece)
                buffers.add(id(piece.obj))
                del piece
            await reply.aclose()
        finally:
            await client.aclose()
    assert hasher.digest() == hashlib.sha256(body).digest()
    assert len(buffers) <= 3  # 40 pieces of 1 MiB, each let go before the next arrived
    assert len(plain_socket._POOL) <= plain_socket.POOL_BUFFERS
