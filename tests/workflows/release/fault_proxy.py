"""An HTTP proxy for tests that injects faults between a client and a real server.

Every request is logged in arrival order; requests that `match` are counted, and every
`every`-th one fails: "500" answers an S3-style InternalError without forwarding, "drop"
forwards the request (so the server acts on it) and then closes the connection without an
answer, the nastiest case for a client. `always` names requests that fail every time, and
`delay` slows matching requests down so a test can kill a client mid-way, and `gate` holds them
until the test lets them through.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Match = Callable[[str, str], bool]  # (method, path) -> bool
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length"}
_ERROR_XML = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
              b"<Message>injected by the test proxy</Message></Error>")


@dataclass(frozen=True)
class Logged:
    seq: int
    method: str
    path: str
    outcome: str  # "forwarded 200", "injected 500", "dropped", ...


@dataclass
class FaultProxy:
    upstream: str
    match: Match = lambda method, path: False
    every: int = 0
    action: str = "500"
    always: Match = lambda method, path: False
    delay: float = 0.0
    gate: threading.Event | None = None  # matching requests wait for it before going on
    log: list[Logged] = field(default_factory=list)
    max_in_flight: int = 0
    _matched: int = 0
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _begin(self, method: str, path: str) -> tuple[int, str | None]:
        """Assign a sequence number and decide this request's fault, under the lock."""
        with self._lock:
            seq = len(self.log)
            self.log.append(Logged(seq, method, path, "pending"))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            if self.always(method, path):
                return seq, self.action
            if self.match(method, path):
                self._matched += 1
                if self.every and self._matched % self.every == 0:
                    return seq, self.action
            return seq, None

    def _end(self, seq: int, outcome: str) -> None:
        with self._lock:
            entry = self.log[seq]
            self.log[seq] = Logged(entry.seq, entry.method, entry.path, outcome)
            self._in_flight -= 1

    def entries(self, method: str | None = None, contains: str = "") -> list[Logged]:
        with self._lock:
            return [e for e in self.log
                    if (method is None or e.method == method) and contains in e.path]

    def forward(self, method: str, path: str, headers: list[tuple[str, str]],
                body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        target = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port,
                                          timeout=60)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length", 0)))


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _handle(self) -> None:
            body = _read_body(self)
            seq, fault = proxy._begin(self.command, self.path)
            if proxy.match(self.command, self.path):
                if proxy.gate is not None:
                    proxy.gate.wait(timeout=60)
                time.sleep(proxy.delay)
            if fault == "500":
                proxy._end(seq, "injected 500")
                self._reply(500, [("Content-Type", "application/xml")], _ERROR_XML)
                return
            headers = [(k, v) for k, v in self.headers.items()
                       if k.lower() not in _HOP_HEADERS]
            headers.append(("Content-Length", str(len(body))))
            status, out_headers, data = proxy.forward(self.command, self.path, headers, body)
            if fault == "drop":
                proxy._end(seq, f"dropped {status}")
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            proxy._end(seq, f"forwarded {status}")
            self._reply(status, [(k, v) for k, v in out_headers
                                 if k.lower() not in _HOP_HEADERS], data)

        def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

    return Handler


@contextmanager
def running(proxy: FaultProxy) -> Iterator[str]:
    """Serve the proxy on a free loopback port in a thread; yield its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(proxy))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
