"""Shared pieces of the S3 release tests: credentials for moto, buckets, dist dirs, listings."""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3

# moto accepts any credentials; against another S3 (FERRY_TEST_S3_ENDPOINT) the environment's
# own AWS credentials are used instead.
EXTERNAL_S3 = bool(os.environ.get("FERRY_TEST_S3_ENDPOINT"))
CREDENTIALS = {} if EXTERNAL_S3 else {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1"}


def client(endpoint: str) -> Any:
    """A plain boto3 client straight to the server (no proxy), for setup and inspection."""
    if EXTERNAL_S3:
        return boto3.client("s3", endpoint_url=endpoint)
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def new_bucket(endpoint: str) -> str:
    name = f"ferry-release-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def make_dist(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def payloads(label: str, count: int, size: int = 64 * 1024) -> dict[str, bytes]:
    """`count` distinct files named after `label`, so a listing shows whose run they came from."""
    return {f"{label}-{i}.tar.gz": (f"{label}{i}".encode() * size)[:size + i]
            for i in range(count)}


def bucket_files(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    """name -> bytes of every object under `prefix/` (the release's assets)."""
    s3 = client(endpoint)
    out = {}
    for item in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        name = item["Key"][len(prefix) + 1:]
        out[name] = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return out


def sha256sum_text(files: dict[str, bytes]) -> str:
    return "".join(f"{hashlib.sha256(files[n]).hexdigest()}  {n}\n" for n in sorted(files))


def cli_env(endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if EXTERNAL_S3 or not k.startswith("AWS_")}
    return {**env, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ferry.cli", "release", "publish", *args]
