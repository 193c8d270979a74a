"""Plain-http connections for the transfer client: httpcore over a bare non-blocking socket,
with a lean path for blob bodies.

Why: on a small machine a pull is CPU-bound in the HTTP body path. httpcore's default backend
reads through anyio and an asyncio transport (a cancel scope, a protocol callback and a queue per
read of at most 256 KiB), then h11 copies every byte twice more; about 1 CPU-second per 512 MiB.
Here httpcore parses the status and headers as always, but a blob body (a plain Content-Length
body) is then read straight from the socket into large buffers (`recv_into`), with no parser in
between: about half the CPU per byte.

Safety is the session's, unchanged: this backend connects only to the literal address that
`check_hop()` returned (a host name is refused, so there is no second, unchecked lookup), and the
body is read from the very connection that carried the request. To know that the parser holds no
byte of the body, the stream stops each read of a response head at the blank line that ends it
(it peeks first), so the body starts exactly at the socket. A body read this way leaves the
parser behind, so its connection is closed afterwards, never reused. https keeps httpcore's own
backend (TLS), and any response the lean path cannot prove clean is read the ordinary way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import select
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx

from registry.transfer.buffer_pool import BufferPool

_HEAD_END = b"\r\n\r\n"
BODY_PIECE = 1024 * 1024  # bytes per piece the lean body path yields
WAKE_BYTES = 256 * 1024  # the lean body path waits for this much at once (SO_RCVLOWAT)
# Smaller bodies go through httpx: they cost little per byte, and so keep their connection
# for the next request (a lean body closes it).
LEAN_MIN = 1024 * 1024
# Receive buffers reused across bodies, allocated as needed up to enough for what a pull-through
# cache holds per blob (4 segments of 16 MiB read ahead, the last 32 MiB kept for late joiners,
# its write and subscriber queues), emptied once no body has been read for POOL_IDLE_SECONDS.
POOL_BUFFERS = 160
POOL_IDLE_SECONDS = 5.0
_POOL = BufferPool(BODY_PIECE, POOL_BUFFERS)


class SocketBackend(httpcore.AsyncNetworkBackend):
    """Connects plain TCP sockets to literal addresses only (the session pinned them)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> SocketStream:
        try:
            address = ipaddress.ip_address(host)
        except ValueError as exc:  # a name would be looked up again here: never
            raise httpcore.ConnectError(f"not a checked address: {host!r}") from exc
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
            if local_address:
                sock.bind((local_address, 0))
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_connect(sock, (str(address), port))
        except TimeoutError as exc:
            sock.close()
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            sock.close()
            raise httpcore.ConnectError(str(exc)) from exc
        except BaseException:
            sock.close()
            raise
        return SocketStream(sock)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used by the transfer client")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class SocketStream(httpcore.AsyncNetworkStream):
    """One connection. After each request it reads in *head* mode: a read ends at the first
    blank line, so when the head is parsed no body byte has been read (`body_at_socket`)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.read_timeout: float | None = None  # the last one httpcore asked for
        self._head = False
        self._tail = b""  # the last bytes of the head so far (a blank line may span reads)
        self.body_at_socket = False
        self._wake_bytes = WAKE_BYTES
        self._lowat = 1  # the socket's SO_RCVLOWAT (the kernel's default)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self.read_timeout = timeout
        try:
            async with asyncio.timeout(timeout):
                if self._head:
                    return await self._read_head(max_bytes)
                self.body_at_socket = False
                return await asyncio.get_running_loop().sock_recv(self.sock, max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def _read_head(self, max_bytes: int) -> bytes:
        loop = asyncio.get_running_loop()
        while True:
            try:
                peeked = self.sock.recv(max_bytes, socket.MSG_PEEK)
                break
            except BlockingIOError:
                await _readable(loop, self.sock)
        if not peeked:
            return b""
        seen = self._tail + peeked
        end = seen.find(_HEAD_END)
        take = len(peeked) if end < 0 else end + len(_HEAD_END) - len(self._tail)
        data = self.sock.recv(take)  # there already: peeked
        if end < 0 or len(data) < take:
            self._tail = (self._tail + data)[-3:]
            return data
        self._head, self._tail = False, b""
        self.body_at_socket = True
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._head, self._tail, self.body_at_socket = True, b"", False
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_sendall(self.sock, buffer)
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self.sock.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS goes through httpcore's own backend")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self.sock
        if info == "is_readable":  # an idle pooled connection the server closed
            if self.sock.fileno() < 0:
                return True
            poller = select.poll()  # not select(): a busy server has descriptors past 1024
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        with contextlib.suppress(OSError):
            if info == "client_addr":
                return self.sock.getsockname()
            if info == "server_addr":
                return self.sock.getpeername()
        return None

    async def body(self, length: int, piece: int = BODY_PIECE) -> AsyncIterator[memoryview]:
        """The next `length` bytes at the socket, in pieces of up to `piece` bytes. Each piece
        is a buffer of its own for as long as the caller (or anyone it passes the piece to)
        keeps it: buffers are reused only once nothing refers to them (buffer_pool.py). Ends
        early when the peer closes: the caller counts. Raises httpx's ReadTimeout/ReadError,
        as the ordinary path would."""
        loop = asyncio.get_running_loop()
        self.body_at_socket = False
        _POOL.enter()
        try:
            async with contextlib.aclosing(self._pieces(loop, length, piece)) as pieces:
                async for view in pieces:
                    yield view
        finally:
            if _POOL.leave():
                loop.call_later(POOL_IDLE_SECONDS, _POOL.clear_if_idle)

    async def _pieces(self, loop: asyncio.AbstractEventLoop, left: int,
                      piece: int) -> AsyncGenerator[memoryview, None]:
        while left > 0:
            size = min(piece, left)
            # A pooled buffer is reused only when no earlier piece's holder still has it.
            whole = _POOL.take() if piece == _POOL.size else bytearray(size)
            buffer = memoryview(whole)[:size]
            filled = 0
            failure: httpx.TransportError | None = None
            try:
                while filled < len(buffer):
                    try:
                        got = self.sock.recv_into(buffer[filled:])
                    except BlockingIOError:
                        await self._await_body(loop, len(buffer) - filled)
                        continue
                    if not got:
                        break
                    filled += got
            except TimeoutError:
                failure = httpx.ReadTimeout("no byte of the body arrived in time")
            except OSError as exc:
                failure = httpx.ReadError(str(exc))
            if filled:  # also before a failure: what arrived is kept, a resume skips it
                left -= filled
                yield buffer[:filled]
            if failure is not None:
                raise failure
            if filled < len(buffer):
                return

    async def _await_body(self, loop: asyncio.AbstractEventLoop, wanted: int) -> None:
        """Wait until `wanted` bytes (at most WAKE_BYTES) are buffered, or the peer closed.

        SO_RCVLOWAT makes the kernel wake us for a batch, not for every packet: when the sender
        is slower than we are, a wake-up per 64 KiB costs more CPU than the bytes. A stall is a
        wait in which not one byte arrived; on a link too slow to fill a batch in that time, the
        rest of this body wakes for any byte again."""
        want = max(1, min(wanted, self._wake_bytes))
        if want != self._lowat:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._lowat = want
        try:
            async with asyncio.timeout(self.read_timeout):
                await _readable(loop, self.sock)
        except TimeoutError:
            try:
                self.sock.recv(1, socket.MSG_PEEK)  # bytes (or the end) are there: no stall
            except BlockingIOError:
                raise TimeoutError from None
            self._wake_bytes = 1


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until `sock` has bytes (or EOF) to read."""
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, _settle, ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def lean_body(response: httpx.Response) -> tuple[SocketStream, int] | None:
    """The stream and length of a body that may be read with `SocketStream.body`, or None
    when it goes through httpx: not our backend, a head that was not read cleanly, a body that
    is not plain bytes of a known length (chunked, or encoded), or a small one."""
    stream = response.extensions.get("network_stream")
    if not isinstance(stream, SocketStream) or not stream.body_at_socket:
        return None
    headers = response.headers
    if "transfer-encoding" in headers:
        return None
    if headers.get("content-encoding", "identity").strip().lower() != "identity":
        return None
    length = headers.get("content-length", "")
    if not length.isdigit() or int(length) < LEAN_MIN:
        return None
    return stream, int(length)


def transport_for(scheme: str, verify: Any, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's transport; for plain http, its pool uses `SocketBackend` (the lean body path)."""
    transport = httpx.AsyncHTTPTransport(verify=verify, trust_env=False, limits=limits)
    if scheme == "http":
        # httpx takes no network backend, so its pool is replaced by the same pool with ours
        # (tests/registry/transfer/test_plain_socket.py fails if this stops taking effect).
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=None, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, http1=True, http2=False,
            network_backend=SocketBackend())
    return transport
