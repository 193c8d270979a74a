"""A cap on request heads for both servers: bytes and header count.

httptools (which uvicorn picks when installed) buffers a header of any size and any number of
headers, so four connections sending unfinished 64 MiB headers grew the registry by 350 MiB.
This protocol counts the bytes of each request head as they arrive; past MAX_HEAD_BYTES, or
past MAX_HEADERS headers, it answers 431 and closes the connection, so at most one read
(<= 256 KiB) beyond the cap is ever held per connection.
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024  # request line and headers together
MAX_HEADERS = 256
MESSAGE = f"request headers exceed {MAX_HEAD_BYTES} bytes or {MAX_HEADERS} fields"


class HeaderLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with MAX_HEAD_BYTES and MAX_HEADERS enforced."""

    error_body = json.dumps({"error": MESSAGE})  # Ollama's error JSON

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def,override]
        self._head_bytes = 0
        self._header_count = 0
        self._in_head = True
        self._refused = False
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
            self._refuse()

    def on_message_begin(self) -> None:
        self._head_bytes = 0
        self._header_count = 0
        self._in_head = True
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count <= MAX_HEADERS:  # past it, dropped: refused when the head ends
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._header_count > MAX_HEADERS:
            self._refuse()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def _refuse(self) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        body = self.error_body.encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.transport.close()
