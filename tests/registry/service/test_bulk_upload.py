"""The registry's bulk upload paths: request body pieces handed to the app uncopied
(BulkHttpProtocol, under uvloop as served and under plain asyncio), appends that keep reading
while a worker hashes and writes, and whole-blob POSTs staged straight beside the blob."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from registry.digests import Hasher
from registry.service.app import BulkHttpProtocol, build_registry_app
from registry.service.storage.filesystem import FilesystemStore

from .conftest import open_fds, sha, wait_open_fds_at_most

REPO = "library/bulk"
MiB = 1024 * 1024


@pytest.fixture(params=["uvloop", "asyncio"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path / "registry"
    with serve_app(build_registry_app(root), http=BulkHttpProtocol, loop=request.param) as url:
        yield url, root


def staged_files(root: Path) -> list[str]:
    return [name for _d, _s, names in os.walk(root) for name in names if "~tmp-" in name]


async def test_a_chunked_upload_arrives_byte_identical(
        served: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    url, root = served
    pieces: list[int] = []
    real = BulkHttpProtocol.on_body

    def counted(self: BulkHttpProtocol, body: bytes) -> None:
        pieces.append(len(body))
        real(self, body)

    monkeypatch.setattr(BulkHttpProtocol, "on_body", counted)
    data = os.urandom(5 * MiB + 12345)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        location = (await client.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
        for start in range(0, len(data), 2 * MiB + 1):  # odd sizes: pieces straddle reads
            end = min(start + 2 * MiB + 1, len(data))
            r = await client.patch(location, content=data[start:end],
                                   headers={"Content-Range": f"{start}-{end - 1}"})
            assert r.status_code == 202 and r.headers["Range"] == f"0-{end - 1}"
        r = await client.put(location, params={"digest": sha(data)})
        assert r.status_code == 201, r.text
        assert (await client.get(f"/v2/{REPO}/blobs/{sha(data)}")).content == data
    assert staged_files(root) == []
    assert sum(pieces) >= len(data)  # every body byte went through the protocol


async def test_a_whole_blob_post_is_published_and_a_wrong_digest_leaves_nothing(
        served: tuple[str, Path]) -> None:
    url, root = served
    data = os.urandom(3 * MiB + 7)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        wrong = sha(data + b"x")
        r = await client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": wrong},
                              content=data)
        assert r.status_code == 400 and r.json()["errors"][0]["code"] == "DIGEST_INVALID"
        assert (await client.head(f"/v2/{REPO}/blobs/{wrong}")).status_code == 404
        assert (await client.head(f"/v2/{REPO}/blobs/{sha(data)}")).status_code == 404
        assert staged_files(root) == [] and not (root / "repositories" / REPO / "_uploads"
                                                 ).exists()
        r = await client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": sha(data)},
                              content=data)
        assert r.status_code == 201, r.text
        assert (await client.get(f"/v2/{REPO}/blobs/{sha(data)}")).content == data
    assert staged_files(root) == []


def test_requests_after_a_big_body_on_one_connection_are_parsed(
        served: tuple[str, Path]) -> None:
    """A big PATCH, then two more requests sent in the same write: requests that share a read
    with a body's tail still parse, and the body pieces passed on uncopied stay whole."""
    url, _root = served
    host, port = url.removeprefix("http://").split(":")
    location = httpx.post(f"{url}/v2/{REPO}/blobs/uploads/").headers["Location"]
    data = os.urandom(3 * MiB)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (f"PATCH {location} HTTP/1.1\r\nHost: x\r\nContent-Range: 0-{len(data) - 1}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        status = f"GET {location} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        sock.sendall(head + data + status + status)
        replies = b""
        while replies.count(b"HTTP/1.1 ") < 3:
            chunk = sock.recv(65536)
            assert chunk
            replies += chunk
    assert replies.count(b"HTTP/1.1 202") == 1 and replies.count(b"HTTP/1.1 204") == 2
    assert replies.lower().count(f"range: 0-{len(data) - 1}".encode()) == 3
    r = httpx.put(f"{url}{location}", params={"digest": sha(data)})
    assert r.status_code == 201, r.text


async def test_filesystem_append_keeps_every_piece_in_order(tmp_path: Path) -> None:
    """Pieces of many sizes, taken while earlier batches are still being written: the file
    and what `observe` saw are the stream, in order."""
    rng = __import__("random").Random(7)
    pieces = [os.urandom(rng.choice([1, 100, 65536, 300_000, MiB, 3 * MiB + 1]))
              for _ in range(40)]

    async def stream():
        for piece in pieces:
            yield piece
            if rng.random() < 0.3:
                await asyncio.sleep(0)

    fs = FilesystemStore(tmp_path / "store")
    hasher = Hasher()
    try:
        total = await fs.append("s/data", stream(), observe=hasher.update)
    finally:
        fs.close()
    whole = b"".join(pieces)
    assert total == len(whole)
    assert (tmp_path / "store" / "s" / "data").read_bytes() == whole
    assert hasher.digest().hex == hashlib.sha256(whole).hexdigest()


async def test_a_cancelled_append_closes_its_file_after_the_write_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that interrupts the append's wait for its last batch leaves the file open for
    the worker still writing it, and closes it once that write ends (never under it)."""
    import threading

    from registry.service.storage import filesystem

    started, release = threading.Event(), threading.Event()
    real = filesystem._write_all

    def slow(fd, pieces, observe):  # type: ignore[no-untyped-def]
        started.set()
        release.wait(10)
        return real(fd, pieces, observe)

    monkeypatch.setattr(filesystem, "_write_all", slow)
    piece = os.urandom(filesystem.PIECE)

    async def stream():
        yield piece
        await asyncio.sleep(60)  # the client goes quiet

    fs = FilesystemStore(tmp_path / "store")
    open_before = open_fds()
    try:
        task = asyncio.ensure_future(fs.append("s/data", stream()))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()  # ends the stream: the append now waits for the batch in flight
        await asyncio.sleep(0.05)
        task.cancel()  # and this interrupts that wait
        with pytest.raises(asyncio.CancelledError):
            await task
        assert open_fds() > open_before  # the write still holds it
        release.set()
        await wait_open_fds_at_most(open_before)
        assert (tmp_path / "store" / "s" / "data").read_bytes() == piece
    finally:
        release.set()
        fs.close()


def test_the_installed_uvicorn_keeps_request_bodies_as_the_fast_path_expects() -> None:
    """BulkHttpProtocol hands body pieces over uncopied only while uvicorn's request cycle
    keeps its pending body as it did when that was written; on a uvicorn that changed it, the
    stock path runs (correct, slower) and this test says so, instead of the speed going quietly."""
    from registry.service import app

    assert app._KNOWN_CYCLE
    assert not app._cycle_has("no_such_attribute_in_the_cycle")
