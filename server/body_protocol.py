"""The model server's HTTP protocol: upload-session bodies reach the app as they were read.

Why: `ferry create` sends a checkpoint's gigabytes as `PATCH /api/uploads/<id>` bodies while the
server quantizes them, on the same few cores. Through uvicorn's httptools path every read of at
most 256 KiB is copied three times more (the parser's body callback, the request's bytearray,
`bytes()` of it for the ASGI message) and costs a pause and a resume of the transport: about
0.7 CPU-seconds per GB on the event loop before the upload's writer sees a byte.

Here, once the head of such a request is parsed (PATCH, a path under `/api/uploads/`, a
Content-Length, no Transfer-Encoding), its body bytes bypass the parser: each read (up to
READ_BYTES at once) is handed to the app as one ASGI message as it is, counted against the
Content-Length; bytes past it are never body. The parser, which then never saw the end of the
body, cannot read a next request on that connection, so the connection closes once both the
response and the body are through (a body the app did not read, e.g. after a 404, is read and
dropped first, as uvicorn does, so the client hears the answer rather than a reset; a body that
arrived whole with its head left the parser in step, and its connection stays open).
Reading pauses while more than HIGH_WATER bytes wait for the app, so memory stays bounded. The
app's checks are unchanged: the session caps the body at its declared size and verifies every
byte against the client's digest before anything is published.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from registry.service.header_limits import HeaderLimitedProtocol

DIRECT_PREFIX = "/api/uploads/"
READ_BYTES = 1024 * 1024
HIGH_WATER = 8 * 1024 * 1024
LOW_WATER = 2 * 1024 * 1024


class _DirectBody:
    """One request's body as the reads that carried it; `receive` replaces the cycle's."""

    def __init__(self, protocol: ModelServerProtocol, cycle: Any, length: int) -> None:
        self.protocol, self.cycle = protocol, cycle
        self.left = length
        self.pieces: deque[bytes] = deque()
        self.buffered = 0
        self._receive = cycle.receive  # after the body: disconnects, as uvicorn reports them

    def feed(self, data: bytes) -> None:
        if len(data) > self.left:
            data = data[:self.left]  # never body: the connection closes after the response
        self.left -= len(data)
        if self.cycle.response_complete:  # answered already: the rest is dropped
            if not self.left:
                self.protocol.transport.close()
            return
        if data:
            self.pieces.append(data)
            self.buffered += len(data)
            if self.buffered > HIGH_WATER:
                self.protocol.flow.pause_reading()
        self.cycle.message_event.set()

    async def receive(self) -> Any:
        cycle = self.cycle
        if cycle.waiting_for_100_continue and not self.protocol.transport.is_closing():
            self.protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        while not self.pieces and self.left and not cycle.disconnected:
            self.protocol.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected or cycle.response_complete:
            return {"type": "http.disconnect"}
        if not self.pieces:  # the whole body was delivered
            return await self._receive()
        piece = self.pieces.popleft()
        self.buffered -= len(piece)
        if self.buffered <= LOW_WATER:
            self.protocol.flow.resume_reading()
        return {"type": "http.request", "body": piece,
                "more_body": bool(self.left or self.pieces)}


class ModelServerProtocol(HeaderLimitedProtocol):
    """HeaderLimitedProtocol, with upload-session bodies read past the parser."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def,override]
        self._direct: _DirectBody | None = None
        self._bypass = False
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._bypass:
            if self._direct is not None:
                self._direct.feed(data)
            return  # past the body, a connection the parser lost step with: closing
        super().data_received(data)
        direct = self._direct
        if direct is not None and direct.left and not self._refused:
            self._bypass = True  # the rest of the body never goes through the parser
            direct.cycle.keep_alive = True  # closed by on_response_complete, body drained
            max_size = getattr(self.transport, "max_size", None)
            if isinstance(max_size, int) and max_size < READ_BYTES:
                self.transport.max_size = READ_BYTES  # type: ignore[attr-defined]

    def on_headers_complete(self) -> None:
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if (cycle is None or cycle is previous or self._refused or self.pipeline
                or self.scope.get("method") != "PATCH"
                or not str(self.scope.get("path", "")).startswith(DIRECT_PREFIX)):
            return
        headers = dict(self.scope.get("headers", []))
        length = headers.get(b"content-length", b"")
        if b"transfer-encoding" in headers or not length.isdigit():
            return
        self._direct = _DirectBody(self, cycle, int(length))
        cycle.receive = self._direct.receive  # type: ignore[method-assign]

    def on_body(self, body: bytes) -> None:
        if self._direct is not None and self._direct.cycle is self.cycle:
            self._direct.feed(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        # The parser saw the whole body: it stays in step, and the connection stays open.
        if self._direct is not None and self._direct.cycle is self.cycle:
            self._direct = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if not self._bypass:
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self._direct is None or not self._direct.left:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._direct = None

