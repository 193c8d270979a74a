"""Send a file as a request body with `sendfile`, over a plain-http connection of its own.

Why: `ferry create` streams a checkpoint (gigabytes) to upload sessions while the server
quantizes it, on the same small machine; through httpx every byte is read into a fresh buffer,
hashed and copied into the socket, and that CPU is taken from the server's. Here the file is
hashed from one reused buffer and its bytes go from the page cache to the socket in the kernel
(`socket.sendfile`), so sending costs about the hash alone.

The request is a plain HTTP/1.1 request with a Content-Length, written by hand, and the response
is read until its own Content-Length; the connection is closed afterwards. Only for `http://`
servers reached without a proxy (`plain_target`): https keeps httpx (TLS cannot sendfile in
user space), and so does anything a proxy would carry. The server checks every byte against the
digest named afterwards, so a file that changes while it is sent is refused there, never stored.
"""

from __future__ import annotations

import socket
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from registry.digests import Hasher

PIECE = 8 * 1024 * 1024  # bytes hashed, then sent, at a time
MAX_RESPONSE_HEAD = 64 * 1024
MAX_RESPONSE_BODY = 1024 * 1024


class SendStopped(Exception):
    """The caller asked to stop between pieces."""


@dataclass(frozen=True)
class PlainTarget:
    host: str
    port: int
    netloc: str  # the Host header
    prefix: str  # the base URL's path, without a trailing slash


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def plain_target(base_url: str) -> PlainTarget | None:
    """Where to connect for `base_url`, or None when it is not plain http reached directly."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme != "http" or not url.hostname:
        return None
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(url.hostname):
        return None
    return PlainTarget(url.hostname, url.port or 80, url.netloc, url.path.rstrip("/"))


def send_file(target: PlainTarget, method: str, path: str, file: Path, size: int,
              hasher: Hasher, timeout: float, connect_timeout: float = 30.0,
              on_sent: Callable[[int], None] | None = None,
              stopped: Callable[[], bool] | None = None) -> Reply:
    """`method path` with the first `size` bytes of `file` as the body, each piece hashed into
    `hasher` before it is sent; returns the server's reply (it may answer early, e.g. 400)."""
    sock = socket.create_connection((target.host, target.port), timeout=connect_timeout)
    try:
        sock.settimeout(timeout)
        head = (f"{method} {target.prefix}{path} HTTP/1.1\r\nHost: {target.netloc}\r\n"
                f"Content-Length: {size}\r\nContent-Type: application/octet-stream\r\n"
                "User-Agent: ferry\r\nConnection: close\r\n\r\n")
        try:
            sock.sendall(head.encode("latin-1"))
            _send_body(sock, file, size, hasher, on_sent, stopped)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed: its reply says why
        return _read_reply(sock)
    finally:
        sock.close()


def _send_body(sock: socket.socket, file: Path, size: int, hasher: Hasher,
               on_sent: Callable[[int], None] | None,
               stopped: Callable[[], bool] | None) -> None:
    buffer = bytearray(min(PIECE, max(size, 1)))
    view = memoryview(buffer)
    with open(file, "rb") as fh:
        offset = 0
        while offset < size:
            if stopped is not None and stopped():
                raise SendStopped("upload stopped")
            n = fh.readinto(view[:min(PIECE, size - offset)])
            if not n:
                raise OSError(f"{file.name} is shorter than {size} bytes (changed while sent)")
            hasher.update(view[:n])
            sent = sock.sendfile(fh, offset, n)
            if sent != n:
                raise OSError(f"{file.name} changed while it was sent")
            offset += n  # sendfile left the file's position there too
            if on_sent is not None:
                on_sent(n)


def _read_reply(sock: socket.socket) -> Reply:
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_RESPONSE_HEAD:
            raise OSError("the server's response head is too long")
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection without a response")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise OSError(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    want = int(length) if length and length.isdigit() else None
    while want is None or len(body) < want:
        if len(body) > MAX_RESPONSE_BODY:
            break
        chunk = sock.recv(65536)
        if not chunk:
            break  # no length: the body ends with the connection
        body += chunk
    return Reply(int(parts[1]), headers, body[:want] if want is not None else body)
