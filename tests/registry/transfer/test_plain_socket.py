"""The plain-http backend and its lean body path (registry/transfer/plain_socket.py).

A scripted HTTP server on loopback writes responses byte for byte (head and body in one write,
a blank line split across writes, chunked bodies, bodies cut short or stalled), so each test
proves what the client does with exactly those bytes: the body it hands on, which path read it,
and whether the connection was reused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import httpcore
import httpx
import pytest
import uvloop

from registry.transfer.plain_socket import LEAN_MIN, SocketBackend, lean_body
from registry.transfer.safe import RedirectPolicy
from registry.transfer.session import Reply, SafeSession

from .helpers import StaticResolver

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
BODY = bytes(range(256)) * 4096 + b"\r\n\r\n tail"  # 1 MiB and a bit, with blank lines inside


class ScriptedServer:
    """Answers each connection with `script`; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(ConnectionError):
            await self.script(reader, writer)
        writer.close()


@contextlib.asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[tuple[ScriptedServer, str]]:
    state = ScriptedServer(script)
    server = await asyncio.start_server(state._handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def session(base: str, stall: float = 5.0) -> SafeSession:
    policy = RedirectPolicy(httpx.URL(base), insecure=True, resolver=StaticResolver({}))
    return SafeSession(policy, stall_timeout=stall)


async def read_request(reader: asyncio.StreamReader) -> bool:
    """One request head; False at the end of the connection."""
    try:
        await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    return True


def head(length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return f"HTTP/1.1 200 OK\r\n{size}{extra}\r\n".encode()


async def collect(reply: Reply) -> tuple[bytes, bool]:
    """The body through `Reply.pieces`, and whether the lean path read it."""
    lean = lean_body(reply.response) is not None
    try:
        return b"".join([bytes(p) async for p in reply.pieces()]), lean
    finally:
        await reply.aclose()


async def keep_alive_blobs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await read_request(reader):
        writer.write(head(len(BODY)) + BODY)  # one write: the body follows the head at once
        await writer.drain()


async def test_a_body_right_behind_the_head_is_read_whole_from_the_socket() -> None:
    async with scripted(keep_alive_blobs) as (_, base):
        client = session(base)
        try:
            body, lean = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert lean
    assert body == BODY


async def test_a_lean_body_closes_its_connection_and_the_next_request_opens_another() -> None:
    async with scripted(keep_alive_blobs) as (server, base):
        client = session(base)
        try:
            first = await collect(await client.send("GET", f"{base}/blob"))
            second = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert first == second == (BODY, True)
    assert server.connections == 2  # the parser never saw the body: never reuse the connection


async def test_a_body_read_by_httpx_keeps_the_connection_for_the_next_request() -> None:
    async with scripted(keep_alive_blobs) as (server, base):
        client = session(base)
        try:
            for _ in range(2):
                reply = await client.send("GET", f"{base}/blob")
                assert await reply.read_capped(len(BODY), "body") == BODY
        finally:
            await client.aclose()
    assert server.connections == 1


async def test_a_pooled_connection_the_server_closed_is_not_reused() -> None:
    small = b"y" * 100

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # keep-alive, then the server drops the idle connection
        writer.write(head(len(small)) + small)
        await writer.drain()

    async with scripted(once) as (server, base):
        client = session(base)
        try:
            first = await collect(await client.send("GET", f"{base}/blob"))
            await asyncio.sleep(0.1)
            second = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert first == second == (small, False)
    assert server.connections == 2


async def test_a_blank_line_split_across_writes_still_ends_the_head() -> None:
    async def split(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        whole = head(len(BODY)) + BODY
        cut = whole.index(b"\r\n\r\n") + 2  # "...\r\n" | "\r\n<body>"
        for piece in (whole[:cut - 1], whole[cut - 1:cut], whole[cut:cut + 1], whole[cut + 1:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)

    async with scripted(split) as (_, base):
        client = session(base)
        try:
            body, lean = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert (body, lean) == (BODY, True)


@pytest.mark.parametrize("extra", ["Transfer-Encoding: chunked\r\n", "Content-Encoding: gzip\r\n"])
async def test_a_chunked_or_encoded_body_goes_through_httpx(extra: str) -> None:
    payload = b"x" * LEAN_MIN  # large enough for the lean path, were it plain

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if "chunked" in extra:
            size = f"{len(payload):x}\r\n".encode()
            writer.write(head(None, extra) + size + payload + b"\r\n0\r\n\r\n")
        else:
            writer.write(head(len(payload), extra) + payload)
        await writer.drain()

    async with scripted(respond) as (_, base):
        client = session(base)
        try:
            body, lean = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert (body, lean) == (payload, False)  # raw bytes, as aiter_raw gives them


async def test_a_small_body_goes_through_httpx_and_keeps_its_connection() -> None:
    small = BODY[:LEAN_MIN - 1]

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(head(len(small)) + small)
            await writer.drain()

    async with scripted(respond) as (server, base):
        client = session(base)
        try:
            first = await collect(await client.send("GET", f"{base}/blob"))
            second = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert first == second == (small, False)
    assert server.connections == 1


async def test_a_body_cut_short_ends_with_what_arrived() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head(len(BODY)) + BODY[:300_000])
        await writer.drain()

    async with scripted(short) as (_, base):
        client = session(base)
        try:
            body, lean = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert lean
    assert body == BODY[:300_000]  # the caller counts, and resumes from here


async def test_a_stalled_body_yields_what_arrived_then_times_out() -> None:
    release = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head(len(BODY)) + BODY[:5000])
        await writer.drain()
        await release.wait()

    async with scripted(stall) as (_, base):
        client = session(base, stall=0.2)
        got = b""
        try:
            reply = await client.send("GET", f"{base}/blob")
            with pytest.raises(httpx.ReadTimeout):
                async for piece in reply.pieces():
                    got += bytes(piece)
            await reply.aclose()
        finally:
            release.set()
            await client.aclose()
    assert got == BODY[:5000]


async def test_a_body_trickling_slower_than_a_batch_is_not_a_stall() -> None:
    """The body path waits for a batch of bytes (SO_RCVLOWAT); a link too slow to fill one
    within the stall timeout still delivers, as long as bytes keep coming."""
    payload = bytes(range(256)) * ((LEAN_MIN + 20 * 1024) // 256)  # the last 20 KiB trickle:
    # 1 KiB every 40 ms, never a batch within the 0.3 s stall timeout

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head(len(payload)) + payload[:LEAN_MIN])
        for start in range(LEAN_MIN, len(payload), 1024):
            writer.write(payload[start:start + 1024])
            await writer.drain()
            await asyncio.sleep(0.04)

    async with scripted(trickle) as (_, base):
        client = session(base, stall=0.3)
        try:
            body, lean = await collect(await client.send("GET", f"{base}/blob"))
        finally:
            await client.aclose()
    assert (body, lean) == (payload, True)


async def test_the_backend_connects_only_to_checked_addresses() -> None:
    with pytest.raises(httpcore.ConnectError, match="not a checked address"):
        await SocketBackend().connect_tcp("localhost", 80)


def test_the_lean_path_works_on_uvloop() -> None:
    """`ferry serve` (uvicorn's auto loop) runs pulls on uvloop."""
    async def main() -> tuple[bytes, bool]:
        async with scripted(keep_alive_blobs) as (_, base):
            client = session(base)
            try:
                return await collect(await client.send("GET", f"{base}/blob"))
            finally:
                await client.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == (BODY, True)


async def test_an_ipv6_literal_connects() -> None:
    server = await asyncio.start_server(keep_alive_blobs, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    base = f"http://[::1]:{port}"
    client = session(base)
    try:
        body, lean = await collect(await client.send("GET", f"{base}/blob"))
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert (body, lean) == (BODY, True)
