"""A lying upstream: wrong bytes, a wrong-digest manifest, a short body, a redirect to loopback.

Each time nothing is cached (no blob, no manifest, no staged leftover), the client gets an error,
the proxy keeps serving, and the next request asks upstream again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from registry import media_types as mt
from registry.digests import Digest
from registry.service import paths
from registry.service.proxy.blob_fetch import BlobFetch
from registry.service.proxy.upstream import UpstreamClient
from registry.service.registry import Registry
from registry.service.storage.filesystem import FilesystemStore
from tests.registry.transfer.tls import tls_server

from .proxy_fixtures import proxy_config, proxy_registry

SMALL = b"small blob " * 100
LARGE = bytes(range(256)) * 8 * 1024  # 2 MiB: streamed in many pieces before it is verified
MANIFEST = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
                       "config": {"mediaType": mt.OCI_CONFIG, "digest": str(Digest.of(b"{}")),
                                  "size": 2}, "layers": []}).encode()


class LyingUpstream:
    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.ranges: list[str] = []
        self.methods: list[str] = []
        self.base = ""
        self.ca_file = ""
        self.blobs = {"corrupt-small": SMALL, "corrupt-large": LARGE, "truncated": LARGE,
                      "redirect": SMALL, "honest": LARGE[::-1], "ranged": LARGE[1:],
                      "ranged-corrupt": LARGE[2:]}
        self.cut_once = True  # the first request for bytes past 1 MiB of "ranged" ends early
        self.digests = {name: Digest.of(data) for name, data in self.blobs.items()}
        self.digests["truncated"] = Digest.of(LARGE + b"t")  # a distinct digest, same size
        self.digests["redirect"] = Digest.of(SMALL + b"r")
        self.app = Starlette(routes=[
            Route("/v2/", lambda r: JSONResponse({})),
            Route("/v2/lie/model/manifests/{ref}", self.manifest, methods=["GET", "HEAD"]),
            Route("/v2/lie/model/blobs/{digest}", self.blob, methods=["GET"]),
        ])

    async def manifest(self, request: Request) -> Response:
        ref = request.path_params["ref"]
        self.hits[f"manifest:{ref}"] += 1
        headers = {"Content-Type": mt.OCI_MANIFEST}
        if ref == "wrong-header":
            headers["Docker-Content-Digest"] = str(Digest.of(b"something else"))
        return Response(MANIFEST, headers=headers)  # by digest: never the digest asked for

    async def blob(self, request: Request) -> Response:
        digest = request.path_params["digest"]
        name = next(n for n, d in self.digests.items() if str(d) == digest)
        self.hits[name] += 1
        self.methods.append(request.method)
        data = self.blobs[name]
        if name == "redirect":
            return RedirectResponse(f"https://127.0.0.2:{request.url.port}/elsewhere", 307)
        if name.startswith("ranged"):
            return self.ranged(request, name, data)
        if name == "honest":  # a registry that ignores Range: the whole blob, always
            self.ranges.append(request.headers.get("range", ""))
        if name.startswith("corrupt"):
            data = data[:-1] + bytes([data[-1] ^ 1])  # same size, one bit off, at the end
        body = data[: len(data) // 2] if name == "truncated" else data

        async def pieces() -> Iterator[bytes]:
            for offset in range(0, len(body), 64 * 1024):
                yield body[offset:offset + 64 * 1024]

        return StreamingResponse(pieces(), headers={"Content-Length": str(len(data))})


    def ranged(self, request: Request, name: str, data: bytes) -> Response:
        """Serves ranges; cuts one segment short once, or flips one byte of its last one."""
        self.ranges.append(request.headers.get("range", ""))
        first, _, last = request.headers["range"].removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last), len(data) - 1)
        body = data[start:end + 1]
        if name == "ranged-corrupt" and end == len(data) - 1:
            body = body[:-1] + bytes([body[-1] ^ 1])
        sent = body
        if name == "ranged" and start >= 1024 * 1024 and self.cut_once:
            self.cut_once, sent = False, body[: len(body) // 2]

        async def pieces() -> Iterator[bytes]:
            yield sent

        headers = {"Content-Length": str(len(body)),
                   "Content-Range": f"bytes {start}-{end}/{len(data)}"}
        return StreamingResponse(pieces(), status_code=206, headers=headers)


@pytest.fixture
def lying(tmp_path: Path):
    upstream = LyingUpstream()
    with tls_server(upstream.app, "127.0.0.1", tmp_path) as (url, ca_file):
        config = proxy_config(url, tmp_path / "ph", ca_file=ca_file,
                              segment_bytes=512 * 1024)
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            upstream.base, upstream.ca_file = url, ca_file
            yield upstream, f"http://{proxy}", tmp_path / "proxy"


def _nothing_cached(root: Path) -> None:
    blobs = root / "blobs"
    stored = [p for p in blobs.rglob("*") if p.is_file()] if blobs.exists() else []
    assert stored == []
    assert [p for p in root.rglob("*") if ".tmp-" in p.name] == []
    assert not (root / "repositories" / "lie" / "model" / "_manifests").exists()


async def _get_fails(http: httpx.AsyncClient, url: str) -> str:
    """The request fails: a 502 with OCI's error JSON, or a body cut off before its end."""
    try:
        response = await http.get(url)
    except httpx.RemoteProtocolError as exc:
        return f"cut off: {exc}"
    assert response.status_code == 502, response.text
    error = response.json()["errors"][0]
    assert error["code"] == "UNAVAILABLE"
    assert "/tmp" not in error["message"]
    return error["message"]


@pytest.mark.parametrize("name", ["corrupt-small", "corrupt-large", "truncated", "redirect"])
async def test_a_lying_blob_caches_nothing_and_the_next_request_asks_again(
        lying, name: str) -> None:
    upstream, proxy, root = lying
    url = f"{proxy}/v2/lie/model/blobs/{upstream.digests[name]}"
    async with httpx.AsyncClient(timeout=30) as http:
        message = await _get_fails(http, url)
        if name == "corrupt-small":
            assert "digest" in message
        if name == "redirect":
            assert "loopback" in message
        hits = upstream.hits[name]
        await _get_fails(http, url)
        assert upstream.hits[name] > hits  # nothing was cached: asked upstream again
        assert (await http.get(f"{proxy}/v2/")).status_code == 200
    _nothing_cached(root)
    assert await FilesystemStore(root).staged() == []


@pytest.mark.parametrize("reference", ["wrong-header", str(Digest.of(b"not the manifest"))])
async def test_a_manifest_that_is_not_what_was_asked_for_caches_nothing(
        lying, reference: str) -> None:
    upstream, proxy, root = lying
    async with httpx.AsyncClient(timeout=30) as http:
        message = await _get_fails(http, f"{proxy}/v2/lie/model/manifests/{reference}")
        assert "digest" in message.lower() or "Docker-Content-Digest" in message
        await _get_fails(http, f"{proxy}/v2/lie/model/manifests/{reference}")
    assert upstream.hits[f"manifest:{reference}"] >= 2
    _nothing_cached(root)


async def test_an_upstream_without_range_support_is_fetched_in_one_stream(lying) -> None:
    upstream, proxy, root = lying
    url = f"{proxy}/v2/lie/model/blobs/{upstream.digests['honest']}"
    async with httpx.AsyncClient(timeout=30) as http:
        got = await http.get(url)
        assert got.status_code == 200 and got.content == LARGE[::-1]
        again = await http.get(url)  # from the cache (or the fetch, if still committing)
        assert again.status_code == 200 and again.content == LARGE[::-1]
    # fetched once; the second request, if its cache check ran just before the commit, only
    # asks (HEAD) whether the upstream serves the digest here
    assert upstream.methods.count("GET") == 1 and upstream.ranges[0].startswith("bytes=0-")
    assert (root / "blobs" / "sha256" / upstream.digests["honest"].hex[:2]).is_dir()


async def test_a_segment_cut_short_is_refetched_alone_and_a_bad_one_stores_nothing(
        lying) -> None:
    upstream, proxy, root = lying
    async with httpx.AsyncClient(timeout=30) as http:
        got = await http.get(f"{proxy}/v2/lie/model/blobs/{upstream.digests['ranged']}")
        assert got.status_code == 200 and got.content == LARGE[1:]
        # four 512 KiB segments, one of them cut short once and resumed where it stopped
        assert upstream.hits["ranged"] == 5
        resumed = [r for r in upstream.ranges if r.startswith("bytes=") and
                   int(r[6:].partition("-")[0]) % (512 * 1024)]
        assert len(resumed) == 1
        url = f"{proxy}/v2/lie/model/blobs/{upstream.digests['ranged-corrupt']}"
        await _get_fails(http, url)
    assert not any(p.name == upstream.digests["ranged-corrupt"].hex
                   for p in (root / "blobs").rglob("*"))
    assert await FilesystemStore(root).staged() == []


async def test_a_fetch_started_after_the_blob_was_stored_fetches_nothing(lying, tmp_path) -> None:
    """The race a second request can hit: its cache check ran before the first fetch
    committed, its fetch starts after. The new fetch finds the blob stored, asks the upstream
    only whether it serves the digest here (so no private blob leaks), and GETs nothing."""
    upstream, _proxy, _root = lying
    config = proxy_config(upstream.base, tmp_path / "h2", ca_file=upstream.ca_file)
    registry = Registry.open(FilesystemStore(tmp_path / "other"))
    digest = upstream.digests["honest"]
    await registry.store.put(paths.blob(digest), LARGE[::-1])
    fetch = BlobFetch(registry, UpstreamClient(config.upstreams[0], config), "lie/model", digest,
                      config.retry)
    await fetch.run()
    assert fetch.error is None and fetch.done.is_set()
    assert fetch.subscribe(0, None) is None  # callers wait for done, link, serve the cache
    assert upstream.methods == ["HEAD"]

    unknown = BlobFetch(registry, UpstreamClient(config.upstreams[0], config), "lie/model",
                        upstream.digests["corrupt-small"], config.retry)
    await registry.store.put(paths.blob(upstream.digests["corrupt-small"]), b"private bytes")
    upstream.blobs.pop("corrupt-small")  # the upstream no longer serves it: nothing is linked
    await unknown.run()
    assert unknown.error is not None
