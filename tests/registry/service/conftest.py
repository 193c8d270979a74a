"""Fixtures for the registry service: a real server on loopback over a temp root."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from registry.service.app import BulkHttpProtocol, build_registry_app


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def registry_root(tmp_path: Path) -> Path:
    return tmp_path / "registry"


@pytest.fixture
def registry_url(registry_root: Path) -> Iterator[str]:
    """The registry app under the protocol `ferry registry serve` runs it with."""
    with serve_app(build_registry_app(registry_root), http=BulkHttpProtocol) as url:
        yield url


@pytest.fixture
async def client(registry_url: str):
    async with httpx.AsyncClient(base_url=registry_url, timeout=30) as c:
        yield c


async def push_blob(client: httpx.AsyncClient, repo: str, data: bytes) -> str:
    """Monolithic upload: POST a session, PUT the bytes with the digest."""
    digest = sha(data)
    r = await client.post(f"/v2/{repo}/blobs/uploads/")
    assert r.status_code == 202, r.text
    r = await client.put(r.headers["Location"], params={"digest": digest}, content=data)
    assert r.status_code == 201, r.text
    return digest


def descriptor(media_type: str, data: bytes, **extra: object) -> dict:
    return {"mediaType": media_type, "digest": sha(data), "size": len(data), **extra}


async def push_image(client: httpx.AsyncClient, repo: str, tag: str, seed: str = "a",
                     media_type: str = "application/vnd.oci.image.manifest.v1+json",
                     **top: object) -> tuple[bytes, str]:
    """Push a config and two layers, then a manifest naming them; return (bytes, digest)."""
    config = json.dumps({"seed": seed}).encode()
    layers = [f"layer-1-{seed}".encode(), f"layer-2-{seed}".encode() * 100]
    for blob in (config, *layers):
        await push_blob(client, repo, blob)
    manifest = {
        "schemaVersion": 2, "mediaType": media_type,
        "config": descriptor("application/vnd.oci.image.config.v1+json", config),
        "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", x) for x in layers],
        **top,
    }
    raw = json.dumps(manifest, indent=2).encode()
    r = await client.put(f"/v2/{repo}/manifests/{tag}", content=raw,
                         headers={"Content-Type": media_type})
    assert r.status_code == 201, r.text
    return raw, sha(raw)


def s3_store(endpoint: str, bucket: str | None = None):
    """An S3Store on `bucket` (default: a fresh one) of the test S3 server (moto)."""
    import uuid

    import boto3
    from botocore.config import Config

    from registry.service.storage.s3 import S3Store

    config = Config(max_pool_connections=32, retries={"max_attempts": 8, "mode": "standard"})
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1",
                          config=config)
    if bucket is None:
        bucket = f"ferry-registry-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
    return S3Store(client, bucket, prefix="registry")


def open_fds() -> int:
    """How many file descriptors this process holds (Linux)."""
    return len(os.listdir("/proc/self/fd"))


async def wait_open_fds_at_most(limit: int) -> None:
    """Wait (2 s at most) until a background write or flush lets go of its file, then check."""
    for _ in range(200):
        if open_fds() <= limit:
            break
        await asyncio.sleep(0.01)
    assert open_fds() <= limit
