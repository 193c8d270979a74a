"""Two registry replicas sharing one S3 bucket (moto server mode): any replica continues any
upload, and what one stores the other serves."""

from __future__ import annotations

import os

import httpx
from conftest import serve_app

from registry.service.app import build_registry_app

from .conftest import push_image, s3_store, sha

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
