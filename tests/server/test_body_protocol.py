"""`ModelServerProtocol`: upload-session bodies read past the HTTP parser (issue 15)."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from ferry.app import build_model_server
from registry.digests import Digest
from registry.store import Store
from server.body_protocol import ModelServerProtocol
from tests.conftest import serve_app


@pytest.fixture
def url(settings) -> Iterator[str]:
    with serve_app(build_model_server(settings), http=ModelServerProtocol) as base:
        yield base


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _head(path: str, length: int) -> bytes:
    return (f"PATCH {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _response(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed before a response"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next((int(v) for k, _, v in (line.partition(": ") for line in lines[1:])
                   if k.lower() == "content-length"), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def _closed(sock: socket.socket) -> bool:
    """Closed by the server at once (uvicorn's idle keep-alive would take 5 s)."""
    sock.settimeout(2)
    return sock.recv(1) == b""


def _temp_files(store: Store) -> list:
    return sorted(store.blobs_dir.glob(".tmp-*"))


def _session(url: str, size: int) -> str:
    return str(httpx.post(f"{url}/api/uploads", json={"size": size}).json()["id"])


def test_a_body_in_many_reads_arrives_whole_and_its_connection_closes(url, store):
    data = os.urandom(5 * 1024 * 1024 + 7)
    upload_id = _session(url, len(data))
    with _connect(url) as sock:
        sock.sendall(_head(f"/api/uploads/{upload_id}", len(data)) + data[:1000])
        time.sleep(0.1)  # the head is parsed alone: the rest goes past the parser
        for i in range(1000, len(data), 300_000):
            sock.sendall(data[i:i + 300_000])
        assert _response(sock)[0] == 204
        assert _closed(sock)  # the parser never saw the body's end: no next request here
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.put(f"{url}/api/uploads/{upload_id}",
                     params={"digest": digest}).status_code == 201
    assert store.blob_path(Digest.parse(digest)).read_bytes() == data
    assert _temp_files(store) == []


def test_a_body_that_came_with_its_head_keeps_the_connection(url, store):
    upload_id = _session(url, 10)
    with _connect(url) as sock:
        sock.sendall(_head(f"/api/uploads/{upload_id}", 10) + b"0123456789")
        assert _response(sock)[0] == 204
        sock.sendall(b"GET /api/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, body = _response(sock)
        assert status == 200 and b"version" in body
    digest = "sha256:" + hashlib.sha256(b"0123456789").hexdigest()
    assert httpx.put(f"{url}/api/uploads/{upload_id}",
                     params={"digest": digest}).status_code == 201


def test_an_unread_body_is_drained_so_the_answer_arrives(url, store):
    size = 3 * 1024 * 1024
    with _connect(url) as sock:
        sock.sendall(_head("/api/uploads/nope", size) + b"x" * 1000)
        time.sleep(0.1)
        sock.sendall(b"x" * (size - 1000))
        status, body = _response(sock)
        assert status == 404 and b"not found" in body
        assert _closed(sock)


def test_a_body_longer_than_the_session_is_refused_and_removed(url, store):
    upload_id = _session(url, 1024 * 1024)
    size = 2 * 1024 * 1024
    with _connect(url) as sock:
        sock.sendall(_head(f"/api/uploads/{upload_id}", size) + b"y" * 1000)
        time.sleep(0.1)
        sock.sendall(b"y" * (size - 1000))
        status, body = _response(sock)
        assert status == 400 and b"longer than the declared" in body
    assert _temp_files(store) == []


def test_a_client_gone_mid_body_fails_the_session(url, store, settings):
    size = 4 * 1024 * 1024
    upload_id = _session(url, size)
    with _connect(url) as sock:
        sock.sendall(_head(f"/api/uploads/{upload_id}", size) + b"z" * 1000)
        time.sleep(0.1)
        sock.sendall(b"z" * (size // 2))
    deadline = time.monotonic() + 10
    while _temp_files(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _temp_files(store) == []
    digest = "sha256:" + hashlib.sha256(b"z" * size).hexdigest()
    refused = httpx.put(f"{url}/api/uploads/{upload_id}", params={"digest": digest})
    assert refused.status_code == 400 and not store.has_blob(Digest.parse(digest))
