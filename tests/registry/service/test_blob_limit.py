"""The registry's blob size limit (FERRY_REGISTRY_MAX_BLOB_BYTES): every way bytes arrive is
counted, an upload that would pass the limit is a 413 SIZE_INVALID, and nothing of it stays."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from registry.service.app import build_registry_app

from .conftest import s3_store, sha

REPO = "library/limited"
LIMIT = 64 * 1024


@pytest.fixture
async def limited(registry_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    with serve_app(build_registry_app(registry_root, max_blob_bytes=LIMIT)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            yield c


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["errors"][0]
    assert error["code"] == "SIZE_INVALID"
    assert error["message"] == f"blob exceeds the limit of {LIMIT} bytes"
    assert error["detail"] == {"limit": LIMIT}


def leftovers(root: Path) -> list[str]:
    """Upload data and blob files: what an over-limit upload must not leave behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and ("_uploads" in p.parts or "blobs" in p.parts))


async def test_a_monolithic_post_over_the_limit_is_refused_and_leaves_nothing(
    limited: httpx.AsyncClient, registry_root: Path,
) -> None:
    data = os.urandom(LIMIT + 1)
    r = await limited.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": sha(data)},
                           content=data)
    assert_refused(r)
    assert leftovers(registry_root) == []
    assert (await limited.head(f"/v2/{REPO}/blobs/{sha(data)}")).status_code == 404


async def test_a_blob_of_exactly_the_limit_is_accepted(limited: httpx.AsyncClient) -> None:
    data = os.urandom(LIMIT)
    r = await limited.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": sha(data)},
                           content=data)
    assert r.status_code == 201, r.text


async def test_a_patch_that_crosses_the_limit_drops_the_session(
    limited: httpx.AsyncClient, registry_root: Path,
) -> None:
    location = (await limited.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
    r = await limited.patch(location, content=b"a" * (LIMIT - 10),
                            headers={"Content-Range": f"0-{LIMIT - 11}"})
    assert r.status_code == 202
    assert_refused(await limited.patch(location, content=b"b" * 20))
    assert leftovers(registry_root) == []
    assert (await limited.get(location)).status_code == 404  # the session is gone


async def test_a_final_put_body_over_the_limit_is_refused(
    limited: httpx.AsyncClient, registry_root: Path,
) -> None:
    location = (await limited.post(f"/v2/{REPO}/blobs/uploads/")).headers["Location"]
    r = await limited.patch(location, content=b"a" * 1000)
    assert r.status_code == 202

    async def body() -> AsyncIterator[bytes]:  # chunked: no Content-Length to go by
        for _ in range(LIMIT // 4096 + 1):
            yield b"c" * 4096

    data = b"a" * 1000 + b"c" * 4096 * (LIMIT // 4096 + 1)
    assert_refused(await limited.put(location, params={"digest": sha(data)}, content=body()))
    assert leftovers(registry_root) == []


async def test_the_limit_comes_from_settings_and_holds_on_s3(
    s3_server: str, settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ferry.app import build_registry_app as build_from_settings
    from ferry.config import Settings

    assert Settings.from_env({}).registry_max_blob_bytes == 0  # no limit by default
    env = Settings.from_env({"FERRY_REGISTRY_MAX_BLOB_BYTES": str(LIMIT)})
    assert env.registry_max_blob_bytes == LIMIT
    for key, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"
                       }.items():
        monkeypatch.setenv(key, value)  # boto3 reads them, as in production
    store = s3_store(s3_server)
    data = os.urandom(LIMIT + 4096)
    app = build_from_settings(settings.with_(
        registry_max_blob_bytes=LIMIT, registry_s3_bucket=store.bucket,
        registry_s3_prefix="registry"))
    with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert_refused(await c.post(f"/v2/{REPO}/blobs/uploads/",
                                        params={"digest": sha(data)}, content=data))
    objects = store.client.list_objects_v2(Bucket=store.bucket).get("Contents", [])
    assert [o["Key"] for o in objects if "_uploads" in o["Key"] or "/blobs/" in o["Key"]] == []
