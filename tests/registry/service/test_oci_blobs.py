"""Blob and upload endpoints against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from conftest import serve_app

from registry.service.app import build_registry_app

from .conftest import push_blob, sha

REPO = "library/llama3"


async def test_base_endpoint_announces_the_api_version(client: httpx.AsyncClient) -> None:
    r = await client.get("/v2/")
    assert r.status_code == 200
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"


async def test_monolithic_post_with_digest_creates_the_blob(client: httpx.AsyncClient) -> None:
    data = os.urandom(5000)
    r = await client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": sha(data)},
                          content=data)
    assert r.status_code == 201
    assert r.headers["Docker-Content-Digest"] == sha(data)
    assert r.headers["Location"] == f"/v2/{REPO}/blobs/{sha(data)}"
    assert (await client.get(f"/v2/{REPO}/blobs/{sha(data)}")).content == data


async def test_get_and_head_report_size_digest_and_etag(client: httpx.AsyncClient) -> None:
    data = os.urandom(300_000)  # larger than the inline body: streamed
    digest = await push_blob(client, "a/b/c/deep", data)
    r = await client.head(f"/v2/a/b/c/deep/blobs/{digest}")
    assert r.status_code == 200
    assert r.headers["Content-Length"] == str(len(data))
    assert r.headers["Docker-Content-Digest"] == digest
    assert r.headers["ETag"] == f'"{digest}"'
    assert r.headers["Accept-Ranges"] == "bytes"
    r = await client.get(f"/v2/a/b/c/deep/blobs/{digest}")
    assert r.content == data


async def test_range_requests_return_206_and_416(client: httpx.AsyncClient) -> None:
    data = os.urandom(400_000)
    digest = await push_blob(client, REPO, data)
    url = f"/v2/{REPO}/blobs/{digest}"
    r = await client.get(url, headers={"Range": "bytes=1000-299999"})
    assert r.status_code == 206
    assert r.content == data[1000:300000]
    assert r.headers["Content-Range"] == f"bytes 1000-299999/{len(data)}"
    r = await client.get(url, headers={"Range": "bytes=-10"})
    assert r.status_code == 206 and r.content == data[-10:]
    r = await client.get(url, headers={"Range": "bytes=399990-"})
    assert r.content == data[399990:]
    r = await client.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416
    assert r.headers["Content-Range"] == f"bytes */{len(data)}"


async def test_chunked_upload_checks_content_range(client: httpx.AsyncClient) -> None:
    data = os.urandom(3 * 1024 * 1024 + 7)
    r = await client.post(f"/v2/{REPO}/blobs/uploads/")
    assert r.status_code == 202
    assert r.headers["Range"] == "0-0"
    upload_id = r.headers["Docker-Upload-UUID"]
    location = r.headers["Location"]
    assert location.endswith(upload_id)
    half = len(data) // 2
    r = await client.patch(location, content=data[:half],
                           headers={"Content-Range": f"0-{half - 1}"})
    assert r.status_code == 202 and r.headers["Range"] == f"0-{half - 1}"
    # a chunk that overlaps what was received: 416 with the current range, nothing appended
    r = await client.patch(location, content=data[10:half],
                           headers={"Content-Range": f"10-{half - 1}"})
    assert r.status_code == 416
    assert r.headers["Range"] == f"0-{half - 1}"
    assert r.json()["errors"][0]["code"] == "BLOB_UPLOAD_INVALID"
    r = await client.get(location)
    assert r.status_code == 204 and r.headers["Range"] == f"0-{half - 1}"
    r = await client.patch(location, content=data[half:],
                           headers={"Content-Range": f"{half}-{len(data) - 1}"})
    assert r.status_code == 202
    r = await client.put(location, params={"digest": sha(data)})
    assert r.status_code == 201
    assert (await client.get(f"/v2/{REPO}/blobs/{sha(data)}")).content == data
    assert (await client.get(location)).status_code == 404  # the session is gone


async def test_put_with_final_chunk_and_wrong_digest_publishes_nothing(
    client: httpx.AsyncClient, registry_root: Path
) -> None:
    data = b"the real bytes"
    wrong = sha(b"other bytes")
    r = await client.post(f"/v2/{REPO}/blobs/uploads/")
    r = await client.put(r.headers["Location"], params={"digest": wrong}, content=data)
    assert r.status_code == 400
    assert r.json()["errors"][0]["code"] == "DIGEST_INVALID"
    for digest in (wrong, sha(data)):
        assert (await client.head(f"/v2/{REPO}/blobs/{digest}")).status_code == 404
    assert not [p for p in (registry_root / "blobs").rglob("*") if p.is_file()]


async def test_invalid_digests_are_400_never_500(client: httpx.AsyncClient) -> None:
    for bad in ("sha256:zz", "md5:abc", "sha256:" + "A" * 63, "nonsense"):
        r = await client.get(f"/v2/{REPO}/blobs/{bad}")
        assert r.status_code == 400, bad
        assert r.json()["errors"][0]["code"] == "DIGEST_INVALID"
    r = await client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": "sha256:nope"},
                          content=b"x")
    assert r.status_code == 400


async def test_unknown_blob_and_session_are_404(client: httpx.AsyncClient) -> None:
    r = await client.get(f"/v2/{REPO}/blobs/{sha(b'never')}")
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "BLOB_UNKNOWN"
    r = await client.get(f"/v2/{REPO}/blobs/uploads/{'0' * 32}")
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "BLOB_UPLOAD_UNKNOWN"
    r = await client.patch(f"/v2/{REPO}/blobs/uploads/..%2F..%2Fetc", content=b"x")
    assert r.status_code in (400, 404)


async def test_delete_session_and_delete_blob(client: httpx.AsyncClient) -> None:
    r = await client.post(f"/v2/{REPO}/blobs/uploads/")
    location = r.headers["Location"]
    assert (await client.delete(location)).status_code == 204
    assert (await client.get(location)).status_code == 404
    digest = await push_blob(client, REPO, b"to delete")
    assert (await client.delete(f"/v2/{REPO}/blobs/{digest}")).status_code == 202
    assert (await client.head(f"/v2/{REPO}/blobs/{digest}")).status_code == 404
    assert (await client.delete(f"/v2/{REPO}/blobs/{digest}")).status_code == 404


async def test_cross_repository_mount_and_automatic_mount(client: httpx.AsyncClient) -> None:
    digest = await push_blob(client, "library/source", b"shared layer")
    # the blob is not visible in another repository until mounted
    assert (await client.head(f"/v2/library/target/blobs/{digest}")).status_code == 404
    r = await client.post("/v2/library/target/blobs/uploads/",
                          params={"mount": digest, "from": "library/source"})
    assert r.status_code == 201
    assert r.headers["Location"] == f"/v2/library/target/blobs/{digest}"
    assert (await client.head(f"/v2/library/target/blobs/{digest}")).status_code == 200
    # from a repository that lacks it: an ordinary session instead
    r = await client.post("/v2/library/third/blobs/uploads/",
                          params={"mount": digest, "from": "library/empty"})
    assert r.status_code == 202 and "Docker-Upload-UUID" in r.headers
    # no `from`: mounted from wherever the registry has it
    r = await client.post("/v2/library/fourth/blobs/uploads/", params={"mount": digest})
    assert r.status_code == 201
    # an unknown digest cannot be mounted
    r = await client.post("/v2/library/fourth/blobs/uploads/", params={"mount": sha(b"?")})
    assert r.status_code == 202


async def test_post_with_digest_and_no_body_probes_for_the_blob(
    client: httpx.AsyncClient,
) -> None:
    digest = await push_blob(client, "library/x", b"known")
    r = await client.post("/v2/library/y/blobs/uploads/", params={"digest": digest})
    assert r.status_code == 201  # already stored: linked, nothing to send
    r = await client.post("/v2/library/y/blobs/uploads/", params={"digest": sha(b"new")})
    assert r.status_code == 202  # unknown: a session to upload into


async def test_upload_session_survives_a_restart(registry_root: Path) -> None:
    data = os.urandom(2 * 1024 * 1024 + 5)
    half = 1024 * 1024 + 3
    with serve_app(build_registry_app(registry_root)) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.post(f"/v2/{REPO}/blobs/uploads/")
            location = r.headers["Location"]
            r = await c.patch(location, content=data[:half],
                              headers={"Content-Range": f"0-{half - 1}"})
            assert r.status_code == 202
    with serve_app(build_registry_app(registry_root)) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            r = await c.get(location)
            assert r.status_code == 204 and r.headers["Range"] == f"0-{half - 1}"
            r = await c.patch(location, content=data[half:],
                              headers={"Content-Range": f"{half}-{len(data) - 1}"})
            assert r.status_code == 202
            r = await c.put(location, params={"digest": sha(data)})
            assert r.status_code == 201, r.text
            assert (await c.get(f"/v2/{REPO}/blobs/{sha(data)}")).content == data


async def test_stale_sessions_are_purged(registry_root: Path) -> None:
    app = build_registry_app(registry_root, upload_session_ttl=60)
    with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            old = (await c.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
            fresh = (await c.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
            removed = await app.state.registry.uploads.purge_stale(now=time.time() + 30)
            assert removed == []
            session = registry_root / "repositories" / REPO / "_uploads" / old.rsplit("/", 1)[1]
            (session / "session").write_text('{"started": %f}' % (time.time() - 120))
            removed = await app.state.registry.uploads.purge_stale()
            assert removed == [old.rsplit("/", 1)[1]]
            assert (await c.get(old)).status_code == 404
            assert (await c.get(fresh)).status_code == 204


async def test_ollama_transfer_style_upload(client: httpx.AsyncClient) -> None:
    """x/transfer: POST ?digest= without a body, PATCH parts with bare Content-Range and
    X-Redirect-Uploads, then a bodyless PUT ?digest=&etag=."""
    data = os.urandom(1_500_000)
    digest = sha(data)
    r = await client.post("/v2/library/model/blobs/uploads/", params={"digest": digest},
                          headers={"X-Redirect-Uploads": "2",
                                   "X-Content-Length": str(len(data))})
    assert r.status_code == 202
    location = r.headers.get("Docker-Upload-Location") or r.headers["Location"]
    parts = [(0, 999_999), (1_000_000, len(data) - 1)]
    for start, end in parts:
        r = await client.patch(location, content=data[start:end + 1],
                               headers={"Content-Range": f"{start}-{end}",
                                        "X-Redirect-Uploads": "1"})
        assert r.status_code == 202
        location = r.headers["Location"]
    r = await client.put(location, params={"digest": digest, "etag": "abc-2"},
                         headers={"Content-Length": "0"})
    assert r.status_code == 201
    r = await client.post("/v2/library/model/blobs/uploads/", params={"digest": digest})
    assert r.status_code == 201  # the next push finds it already there


async def test_a_chunk_cut_off_by_a_disconnect_can_be_resumed(
    client: httpx.AsyncClient, registry_url: str,
) -> None:
    data = os.urandom(2 * 1024 * 1024)
    location = (await client.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
    host, port = registry_url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write((f"PATCH {location} HTTP/1.1\r\nHost: {host}\r\n"
                  f"Content-Type: application/octet-stream\r\n"
                  f"Content-Range: 0-{len(data) - 1}\r\nContent-Length: {len(data)}\r\n\r\n"
                  ).encode() + data[:1024 * 1024])
    await writer.drain()
    writer.close()  # gone halfway through the chunk
    await writer.wait_closed()
    for _ in range(100):  # the server notices the disconnect on its own schedule
        r = await client.get(location)
        if r.status_code == 204 and r.headers["Range"] == f"0-{1024 * 1024 - 1}":
            break
        await asyncio.sleep(0.05)
    received = int(r.headers["Range"].split("-")[1]) + 1
    assert received == 1024 * 1024
    r = await client.patch(location, content=data[received:],
                           headers={"Content-Range": f"{received}-{len(data) - 1}"})
    assert r.status_code == 202
    r = await client.put(location, params={"digest": sha(data)})
    assert r.status_code == 201, r.text


async def test_an_empty_blob_uploads_through_a_session_with_no_chunk(
    client: httpx.AsyncClient,
) -> None:
    empty = sha(b"")
    r = await client.post(f"/v2/{REPO}/blobs/uploads/")
    assert r.status_code == 202
    r = await client.put(r.headers["Location"], params={"digest": empty})
    assert r.status_code == 201, r.text
    r = await client.get(f"/v2/{REPO}/blobs/{empty}")
    assert r.status_code == 200 and r.content == b""
