"""Two registry replicas sharing one S3 bucket (moto server mode): any replica continues any
upload, and what one stores the other serves."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
from conftest import serve_app

from registry import media_types as mt
from registry.service.app import build_registry_app
from registry.service.gc import DEFAULT_GRACE, collect_garbage
from registry.service.tags import TagStore

from .conftest import push_blob, push_image, s3_store, sha

REPO = "library/shared"


async def test_replicas_share_uploads_manifests_and_tags(s3_server: str) -> None:
    first = s3_store(s3_server)
    second = s3_store(s3_server, bucket=first.bucket)
    data = os.urandom(3 * 1024 * 1024 + 11)
    half = len(data) // 2
    with serve_app(build_registry_app(store=first)) as url_a, \
            serve_app(build_registry_app(store=second)) as url_b:
        async with httpx.AsyncClient(base_url=url_a, timeout=60) as a, \
                httpx.AsyncClient(base_url=url_b, timeout=60) as b:
            location = (await a.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
            r = await a.patch(location, content=data[:half],
                              headers={"Content-Range": f"0-{half - 1}"})
            assert r.status_code == 202
            r = await b.patch(location, content=data[half:],
                              headers={"Content-Range": f"{half}-{len(data) - 1}"})
            assert r.status_code == 202 and r.headers["Range"] == f"0-{len(data) - 1}"
            r = await a.put(location, params={"digest": sha(data)})
            assert r.status_code == 201, r.text
            r = await b.get(f"/v2/{REPO}/blobs/{sha(data)}", headers={"Range": "bytes=5-1000004"})
            assert r.status_code == 206 and r.content == data[5:1000005]

            raw, digest = await push_image(b, REPO, "v1")
            r = await a.get(f"/v2/{REPO}/manifests/v1")
            assert r.content == raw and r.headers["Docker-Content-Digest"] == digest
            assert (await a.get(f"/v2/{REPO}/tags/list")).json()["tags"] == ["v1"]
            assert (await a.get("/v2/_catalog")).json()["repositories"] == [REPO]
            r = await a.put(f"/v2/{REPO}/blobs/uploads/{'f' * 32}", params={"digest": digest})
            assert r.status_code == 404


async def test_serve_and_gc_use_the_bucket_named_in_settings(
    s3_server: str, monkeypatch, capsys, tmp_path,
) -> None:
    from ferry.app import build_registry_app as build_from_settings
    from ferry.cli import main
    from ferry.config import Settings

    store = s3_store(s3_server)
    env = {"FERRY_HOME": str(tmp_path), "FERRY_REGISTRY_S3_BUCKET": store.bucket,
           "FERRY_REGISTRY_S3_PREFIX": "registry", "AWS_ENDPOINT_URL": s3_server,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with serve_app(build_from_settings(Settings.from_env())) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            raw, _ = await push_image(c, REPO, "kept")
            orphan = sha(b"orphan")
            r = await c.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": orphan},
                             content=b"orphan")
            assert r.status_code == 201
            assert (await c.delete(f"/v2/{REPO}/blobs/{orphan}")).status_code == 202
    assert not (tmp_path / "registry").exists()  # nothing went to the filesystem root
    assert await asyncio.to_thread(main, ["registry", "gc", "--dry-run"]) == 0
    assert "kept 1 recent unreferenced" in capsys.readouterr().out  # S3 times cannot be aged
    report = await collect_garbage(s3_store(s3_server, store.bucket),
                                   now=time.time() + 2 * DEFAULT_GRACE)
    assert [str(d) for d in report.swept] == [orphan]
    assert await store.stat(f"blobs/sha256/{orphan[7:9]}/{orphan[7:]}") is None
    with serve_app(build_registry_app(store=s3_store(s3_server, store.bucket))) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            assert (await c.get(f"/v2/{REPO}/manifests/kept")).content == raw


async def test_blob_gets_redirect_to_presigned_s3_urls_when_enabled(s3_server: str) -> None:
    store = s3_store(s3_server)
    store.redirect_ttl = 300
    data = os.urandom(100_000)
    with serve_app(build_registry_app(store=store)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            r = await c.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": sha(data)},
                             content=data)
            assert r.status_code == 201
            r = await c.get(f"/v2/{REPO}/blobs/{sha(data)}")
            assert r.status_code == 307
            assert r.headers["Location"].startswith(s3_server)
            assert r.headers["Docker-Content-Digest"] == sha(data)
            async with httpx.AsyncClient(timeout=60) as anonymous:  # no registry credentials
                fetched = await anonymous.get(r.headers["Location"])
            assert fetched.status_code == 200 and fetched.content == data
            head = await c.head(f"/v2/{REPO}/blobs/{sha(data)}")
            assert head.status_code == 200 and head.headers["Content-Length"] == str(len(data))


async def test_concurrent_pushes_to_one_tag_through_two_replicas_lose_no_move(
    s3_server: str,
) -> None:
    first = s3_store(s3_server)
    second = s3_store(s3_server, bucket=first.bucket)
    with serve_app(build_registry_app(store=first)) as url_a, \
            serve_app(build_registry_app(store=second)) as url_b:
        async with httpx.AsyncClient(base_url=url_a, timeout=120) as a, \
                httpx.AsyncClient(base_url=url_b, timeout=120) as b:
            config = await push_blob(a, REPO, b"{}")
            bodies = [json.dumps({
                "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
                "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 2},
                "layers": [], "annotations": {"n": str(i)}}).encode() for i in range(32)]
            results = await asyncio.gather(*(
                (a, b)[i % 2].put(f"/v2/{REPO}/manifests/race", content=body,
                                  headers={"Content-Type": mt.OCI_MANIFEST})
                for i, body in enumerate(bodies)))
            assert [r.status_code for r in results] == [201] * len(bodies)
            final_a = await a.get(f"/v2/{REPO}/manifests/race")
            final_b = await b.get(f"/v2/{REPO}/manifests/race")
    assert final_a.content in bodies and final_b.content == final_a.content
    history = await TagStore(s3_store(s3_server, first.bucket)).history(REPO, "race")
    assert sorted(str(m.digest) for m in history) == sorted(sha(b) for b in bodies)
    assert str(history[-1].digest) == sha(final_a.content)  # the last move is the current one
    assert [m.at_ns for m in history] == sorted({m.at_ns for m in history})
