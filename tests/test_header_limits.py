"""Both servers cap request heads (64 KiB, 256 fields): 431 and a closed connection, and a few
unfinished huge headers leave memory flat. Loopback only, bounded in bytes and time."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import serve_app

from registry.service.header_limits import MAX_HEAD_BYTES, HeaderLimitedProtocol


@pytest.fixture(params=["registry", "model server"])
def server(request: pytest.FixtureRequest, tmp_path: Path, settings) -> Iterator[tuple[str, int]]:
    if request.param == "registry":
        from registry.service.app import BulkHttpProtocol, build_registry_app

        app, protocol, path = build_registry_app(tmp_path / "reg"), BulkHttpProtocol, "/v2/"
    else:
        from ferry.app import build_model_server

        app, protocol, path = build_model_server(settings), HeaderLimitedProtocol, "/api/tags"
    with serve_app(app, http=protocol) as url:
        port = url.rsplit(":", 1)[1]
        yield path, int(port)


def exchange(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # refused before we finished: the answer is already waiting
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def request(path: str, *headers: bytes) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".encode()
            + b"".join(headers) + b"\r\n")


def test_ordinary_heads_are_served(server: tuple[str, int]) -> None:
    path, port = server
    reply = exchange(port, request(path, *[b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(100)]))
    assert reply.startswith(b"HTTP/1.1 200")


def test_too_many_headers_are_431(server: tuple[str, int]) -> None:
    path, port = server
    reply = exchange(port, request(path, *[b"X-%d: v\r\n" % i for i in range(300)]))
    assert reply.startswith(b"HTTP/1.1 431")
    reply = exchange(port, request(path, *[b"X-%d: v\r\n" % i for i in range(100_000)]))
    assert reply.startswith(b"HTTP/1.1 431") or reply == b""


def test_one_huge_header_is_431(server: tuple[str, int]) -> None:
    path, port = server
    reply = exchange(port, request(path, b"X-Big: " + b"a" * (16 * 1024 * 1024) + b"\r\n"))
    assert reply.startswith(b"HTTP/1.1 431") or reply == b""


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def send_unfinished_header(port: int, sent: list[int]) -> None:
    """Up to 64 MiB of one header that never ends; stops when the server hangs up."""
    piece = b"a" * (256 * 1024)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        total = 0
        try:
            while total < 64 * 1024 * 1024:
                sock.sendall(piece)
                total += len(piece)
        except OSError:
            pass
        sent.append(total)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_unfinished_huge_headers_leave_memory_flat(server: tuple[str, int]) -> None:
    _, port = server
    before = rss_bytes()
    sent: list[int] = []
    threads = [threading.Thread(target=send_unfinished_header, args=(port, sent))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(sent) == 4
    # refused after the cap: the kernel's socket buffers take a few MiB more before the reset
    assert all(total < 32 * 1024 * 1024 for total in sent), sent
    assert rss_bytes() - before < 48 * 1024 * 1024
    assert MAX_HEAD_BYTES == 64 * 1024


def test_both_start_commands_use_the_capped_protocol(monkeypatch, tmp_path: Path) -> None:
    import uvicorn

    from ferry.cli import main
    from registry.service.app import BulkHttpProtocol

    seen: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(kw["http"]))
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    assert main(["serve"]) == 0 and main(["registry", "serve"]) == 0
    assert seen == [HeaderLimitedProtocol, BulkHttpProtocol]
    assert issubclass(BulkHttpProtocol, HeaderLimitedProtocol)
