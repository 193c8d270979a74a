"""S3 (and S3-compatible) release store.

Layout under `s3://BUCKET/PREFIX`:

    PREFIX/<release>/<asset>     the assets, e.g. PREFIX/v1.2.0/ferry-0.1.0.tar.gz
    PREFIX/<release>.json        the release document: name, tag, draft, prerelease
    PREFIX/<release>.lock        the lease: holder and expiry, while a run holds it

The lease is taken with a conditional write (`If-None-Match: *`), taken over from an expired
holder and renewed with `If-Match: <etag>`, and released with a conditional delete, so two runs
can never both believe they hold it. Expiry uses the runs' clocks: keep hosts NTP-synced.
Assets are uploaded with an S3-computed SHA-256 checksum, which verification reads back.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from workflows.release.store import (
    LeaseHeld,
    LeaseLost,
    LocalAsset,
    Progress,
    ReleaseRef,
    RemoteAsset,
    StoreError,
    transient_status,
)


def _classify(exc: Exception, what: str) -> StoreError:
    """One StoreError for any botocore failure: 429/5xx and transport errors are transient."""
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = exc.response.get("Error", {}).get("Code", "")
        return StoreError(f"{what}: {status} {code}", transient=transient_status(status),
                          status=status)
    return StoreError(f"{what}: {exc}", transient=True)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


class _CountingReader:
    """A file wrapper that reports bytes read; botocore may seek back and re-read on retry."""

    def __init__(self, handle: Any, progress: Progress) -> None:
        self._handle = handle
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        chunk = self._handle.read(size)
        self._progress(self._handle.tell())
        return chunk

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()


class S3Lease:
    """The lock object, held by etag: every change is conditional on the etag we wrote."""

    def __init__(self, store: S3ReleaseStore, key: str, holder: str, etag: str,
                 expires_at: float) -> None:
        self._store, self._key, self.holder = store, key, holder
        self._etag, self.expires_at = etag, expires_at

    def renew(self, ttl: float) -> None:
        expires_at = time.time() + ttl
        try:
            self._etag = self._store._put_lock(self._key, self.holder, expires_at,
                                               IfMatch=self._etag)
        except ClientError as exc:
            if _status(exc) in (404, 412):
                raise LeaseLost(f"the lease {self._key} was taken over or removed") from exc
            raise _classify(exc, "renewing the lease") from exc
        self.expires_at = expires_at

    def release(self) -> None:
        # Already taken over, gone, or unreachable: then it expires on its own.
        with contextlib.suppress(ClientError, BotoCoreError):
            self._store.client.delete_object(Bucket=self._store.bucket, Key=self._key,
                                             IfMatch=self._etag)


class S3ReleaseStore:
    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None,
                 client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.description = f"s3://{bucket}/{self.prefix}"
        # The job owns retries (with its configured delays), so botocore must not retry too.
        config = Config(retries={"total_max_attempts": 1}, connect_timeout=10, read_timeout=60,
                        max_pool_connections=32)
        self.client: Any = client or boto3.client("s3", endpoint_url=endpoint_url, config=config)

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _put_lock(self, key: str, holder: str, expires_at: float, **condition: str) -> str:
        body = json.dumps({"holder": holder, "expires_at": expires_at}).encode()
        response = self.client.put_object(Bucket=self.bucket, Key=key, Body=body,
                                          ContentType="application/json", **condition)
        return str(response["ETag"])

    def acquire_lease(self, ref: ReleaseRef, holder: str, ttl: float) -> S3Lease:
        key = self._key(f"{ref.name}.lock")
        expires_at = time.time() + ttl
        try:
            etag = self._put_lock(key, holder, expires_at, IfNoneMatch="*")
            return S3Lease(self, key, holder, etag, expires_at)
        except ClientError as exc:
            if _status(exc) not in (409, 412):
                raise _classify(exc, "taking the lease") from exc
        return self._take_over_expired(key, holder, ttl)

    def _take_over_expired(self, key: str, holder: str, ttl: float) -> S3Lease:
        try:
            current = self.client.get_object(Bucket=self.bucket, Key=key)
            doc = json.loads(current["Body"].read())
        except ClientError as exc:
            if _status(exc) == 404:  # released between our write and our read: try again
                raise LeaseHeld("(just released)", time.time()) from exc
            raise _classify(exc, "reading the lease") from exc
        if float(doc.get("expires_at", 0)) > time.time():
            raise LeaseHeld(str(doc.get("holder")), float(doc["expires_at"]))
        expires_at = time.time() + ttl
        try:  # conditional on the expired holder's etag: only one run can take it over
            etag = self._put_lock(key, holder, expires_at, IfMatch=current["ETag"])
        except ClientError as exc:
            if _status(exc) in (404, 409, 412):
                raise LeaseHeld("(taken over by another run)", None) from exc
            raise _classify(exc, "taking over the lease") from exc
        return S3Lease(self, key, holder, etag, expires_at)

    def retag(self, ref: ReleaseRef) -> str:
        key = self._key(f"{ref.name}.json")
        try:
            doc = json.loads(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
            action = "unchanged" if doc.get("tag") == ref.tag else f"moved from {doc.get('tag')}"
        except ClientError as exc:
            if _status(exc) != 404:
                raise _classify(exc, "reading the release document") from exc
            doc, action = {"name": ref.name, "draft": True}, "created"
        except BotoCoreError as exc:
            raise _classify(exc, "reading the release document") from exc
        doc.update(tag=ref.tag, prerelease=ref.prerelease, updated_at=time.time())
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=json.dumps(doc).encode(),
                                   ContentType="application/json")
        except (ClientError, BotoCoreError) as exc:
            raise _classify(exc, "writing the release document") from exc
        return action

    def list_assets(self, ref: ReleaseRef, with_digests: bool = False) -> list[RemoteAsset]:
        base = self._key(ref.name) + "/"
        assets = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base)
            for page in pages:
                for item in page.get("Contents", []):
                    sha = self._digest(item["Key"]) if with_digests else None
                    assets.append(RemoteAsset(name=item["Key"][len(base):], size=item["Size"],
                                              sha256=sha, handle=item["Key"]))
        except (ClientError, BotoCoreError) as exc:
            raise _classify(exc, f"listing {base}") from exc
        return assets

    def _digest(self, key: str) -> str | None:
        head = self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        checksum = head.get("ChecksumSHA256")
        if not checksum or "-" in checksum:  # absent, or a multipart checksum-of-checksums
            return None
        return base64.b64decode(checksum).hex()

    def delete_asset(self, ref: ReleaseRef, asset: RemoteAsset) -> None:
        try:  # S3 deletes are idempotent: a missing key is a success
            self.client.delete_object(Bucket=self.bucket, Key=asset.handle)
        except (ClientError, BotoCoreError) as exc:
            raise _classify(exc, f"deleting {asset.name}") from exc

    def upload_asset(self, ref: ReleaseRef, asset: LocalAsset, progress: Progress) -> None:
        key = self._key(ref.name, asset.name)
        try:
            with asset.path.open("rb") as handle:
                self.client.put_object(
                    Bucket=self.bucket, Key=key, Body=_CountingReader(handle, progress),
                    ContentLength=asset.size, ChecksumAlgorithm="SHA256",
                    Metadata={"sha256": asset.sha256})
        except (ClientError, BotoCoreError) as exc:
            raise _classify(exc, f"uploading {asset.name}") from exc

    def close(self) -> None:
        self.client.close()
