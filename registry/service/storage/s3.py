"""The S3 BlobStore (boto3): keys are object keys under an optional prefix in one bucket.

S3 has no append, so `append` writes each call as one segment object `<key>.seg/<offset>`; `stat`,
`read` and `commit` see a key with segments as their concatenation, and `commit` turns them into
one object (a server-side copy for a single segment, else a multipart upload). Every S3 call is
blocking boto3, so each runs on a worker thread. Replicas share nothing but the bucket.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from botocore.exceptions import ClientError

from registry.service.storage.base import STAGING_MARKER, KeyNotFound, Stat, is_staged_leaf

PART = 8 * 1024 * 1024  # multipart part size for appends and commits (S3 minimum is 5 MiB)
PIECE = 1024 * 1024
SEGMENTS = ".seg"
T = TypeVar("T")


def _missing(exc: ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


def _lost_race(exc: ClientError) -> bool:
    """A conditional write refused: the object changed (412), a concurrent conditional write is
    in flight (409), or the expected object is gone."""
    code = exc.response.get("Error", {}).get("Code", "")
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409") \
        or _missing(exc)


class S3Store:
    def __init__(self, client: Any, bucket: str, prefix: str = "", workers: int = 32,
                 redirect_ttl: int = 0) -> None:
        """`redirect_ttl` > 0: blob GETs answer 307 to a presigned URL valid that many seconds,
        so bytes flow from S3 to the client, not through the registry."""
        self.client = client
        self.bucket = bucket
        self.redirect_ttl = redirect_ttl
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="ferry-s3")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid storage key {key!r}")
        return self.prefix + key

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    # -- segments ------------------------------------------------------------------------------

    async def _objects(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under a full key prefix (paginated)."""
        found: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._call(self.client.list_objects_v2, Bucket=self.bucket,
                                    Prefix=prefix, **extra)
            found += page.get("Contents", [])
            if not page.get("IsTruncated"):
                return found
            token = page["NextContinuationToken"]

    async def _segments(self, key: str) -> list[dict[str, Any]]:
        """The segment objects of `key`, in offset order (their names are zero-padded)."""
        segs = await self._objects(f"{self._key(key)}{SEGMENTS}/")
        return sorted(segs, key=lambda s: s["Key"])

    # -- the protocol --------------------------------------------------------------------------

    async def stat(self, key: str) -> Stat | None:
        try:
            head = await self._call(self.client.head_object, Bucket=self.bucket,
                                    Key=self._key(key))
            return Stat(size=head["ContentLength"], mtime=head["LastModified"].timestamp())
        except ClientError as exc:
            if not _missing(exc):
                raise
        segs = await self._segments(key)
        if not segs:
            return None
        return Stat(size=sum(s["Size"] for s in segs),
                    mtime=max(s["LastModified"].timestamp() for s in segs))

    async def read(
        self, key: str, offset: int = 0, length: int | None = None
    ) -> AsyncIterator[bytes | memoryview]:
        stat = await self.stat(key)
        if stat is None:
            raise KeyNotFound(key)
        end = stat.size if length is None else min(stat.size, offset + length)
        if end <= offset:
            return
        segs: list[dict[str, Any]] = [{"Key": self._key(key), "Size": stat.size}]
        if await self._is_segmented(key):
            segs = await self._segments(key)
        base = 0
        for seg in segs:
            lo, hi = max(offset, base), min(end, base + seg["Size"])
            if lo < hi:
                async for piece in self._range(seg["Key"], lo - base, hi - base):
                    yield piece
            base += seg["Size"]

    async def _is_segmented(self, key: str) -> bool:
        try:
            await self._call(self.client.head_object, Bucket=self.bucket, Key=self._key(key))
            return False
        except ClientError as exc:
            if _missing(exc):
                return True
            raise

    async def _range(self, full_key: str, start: int, stop: int) -> AsyncIterator[bytes]:
        resp = await self._call(self.client.get_object, Bucket=self.bucket, Key=full_key,
                                Range=f"bytes={start}-{stop - 1}")
        body = resp["Body"]
        try:
            while piece := await self._call(body.read, PIECE):
                yield piece
        finally:
            body.close()

    async def get(self, key: str) -> bytes:
        try:
            resp = await self._call(self.client.get_object, Bucket=self.bucket,
                                    Key=self._key(key))
            return await self._call(resp["Body"].read)
        except ClientError as exc:
            if not _missing(exc):
                raise
        if await self._segments(key):
            return b"".join([piece async for piece in self.read(key)])
        raise KeyNotFound(key)

    async def put(self, key: str, data: bytes) -> None:
        await self._call(self.client.put_object, Bucket=self.bucket, Key=self._key(key),
                         Body=data)

    async def get_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The version is the ETag. A key that only has segments (appended) has no ETag: it
        reads as unversioned, so the first `put_if` writes a plain object that supersedes them."""
        try:
            resp = await self._call(self.client.get_object, Bucket=self.bucket,
                                    Key=self._key(key))
            return await self._call(resp["Body"].read), str(resp["ETag"])
        except ClientError as exc:
            if not _missing(exc):
                raise
        if await self._segments(key):
            return b"".join([piece async for piece in self.read(key)]), None
        return b"", None

    async def put_if(self, key: str, data: bytes, expected: str | None) -> bool:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        try:
            await self._call(self.client.put_object, Bucket=self.bucket, Key=self._key(key),
                             Body=data, **condition)
        except ClientError as exc:
            if _lost_race(exc):
                return False
            raise
        return True

    async def append(
        self, key: str, chunks: AsyncIterable[bytes | memoryview],
        observe: Callable[[bytes | memoryview], object] | None = None,
    ) -> int:
        stat = await self.stat(key)
        offset = stat.size if stat else 0
        if stat is not None and not await self._is_segmented(key):
            # a plain object becomes the first segment, so segments alone describe the key
            await self._call(self.client.copy_object, Bucket=self.bucket,
                             Key=f"{self._key(key)}{SEGMENTS}/{0:020d}-0",
                             CopySource={"Bucket": self.bucket, "Key": self._key(key)})
            await self._call(self.client.delete_object, Bucket=self.bucket, Key=self._key(key))
        # A unique suffix: two replicas appending at once both keep their bytes (a history log
        # stays whole; an upload raced that way fails its digest check instead of losing data).
        segment = f"{self._key(key)}{SEGMENTS}/{offset:020d}-{uuid.uuid4().hex[:12]}"
        return await self._upload(segment, chunks, observe)

    async def _upload(self, full_key: str, chunks: AsyncIterable[bytes | memoryview],
                      observe: Callable[[Any], object] | None = None,
                      ) -> int:
        """Write a stream to one object: a single PUT when small, else a multipart upload.
        Bytes received before a failure are still written, as the protocol promises."""
        buffer = bytearray()
        upload_id: str | None = None
        parts: list[dict[str, Any]] = []
        total = 0
        try:
            async for chunk in chunks:
                if observe is not None:
                    observe(chunk)
                buffer += chunk
                total += len(chunk)
                if len(buffer) >= PART:
                    if upload_id is None:
                        upload_id = (await self._call(
                            self.client.create_multipart_upload, Bucket=self.bucket,
                            Key=full_key))["UploadId"]
                    parts.append(await self._part(full_key, upload_id, len(parts) + 1,
                                                  bytes(buffer)))
                    buffer.clear()
        finally:
            await asyncio.shield(self._finish_upload(full_key, upload_id, parts, bytes(buffer)))
        return total

    async def _part(self, full_key: str, upload_id: str, number: int, data: bytes) -> dict:
        resp = await self._call(self.client.upload_part, Bucket=self.bucket, Key=full_key,
                                UploadId=upload_id, PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": resp["ETag"]}

    async def _finish_upload(self, full_key: str, upload_id: str | None,
                             parts: list[dict[str, Any]], rest: bytes) -> None:
        if upload_id is None:
            if rest:
                await self._call(self.client.put_object, Bucket=self.bucket, Key=full_key,
                                 Body=rest)
            return
        if rest:
            parts.append(await self._part(full_key, upload_id, len(parts) + 1, rest))
        await self._call(self.client.complete_multipart_upload, Bucket=self.bucket,
                         Key=full_key, UploadId=upload_id, MultipartUpload={"Parts": parts})

    async def commit(self, key: str, staged: str) -> None:
        if not await self._is_segmented(staged):
            await self._call(self.client.copy_object, Bucket=self.bucket, Key=self._key(key),
                             CopySource={"Bucket": self.bucket, "Key": self._key(staged)})
        else:
            segs = await self._segments(staged)
            if not segs:
                raise KeyNotFound(staged)
            if len(segs) == 1:
                await self._call(self.client.copy_object, Bucket=self.bucket,
                                 Key=self._key(key),
                                 CopySource={"Bucket": self.bucket, "Key": segs[0]["Key"]})
            else:
                await self._upload(self._key(key), self.read(staged))
        await self.delete(staged)

    async def delete(self, key: str) -> None:
        full = self._key(key)
        doomed = [{"Key": full}]
        doomed += [{"Key": o["Key"]} for o in await self._objects(full + "/")]
        doomed += [{"Key": o["Key"]} for o in await self._objects(full + SEGMENTS + "/")]
        for start in range(0, len(doomed), 1000):
            await self._call(self.client.delete_objects, Bucket=self.bucket,
                             Delete={"Objects": doomed[start:start + 1000], "Quiet": True})

    async def list(self, prefix: str) -> list[str]:
        full = self._key(prefix) + "/" if prefix else self.prefix
        names: set[str] = set()
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._call(self.client.list_objects_v2, Bucket=self.bucket,
                                    Prefix=full, Delimiter="/", **extra)
            names.update(p["Prefix"][len(full):].rstrip("/") for p in
                         page.get("CommonPrefixes", []))
            names.update(o["Key"][len(full):] for o in page.get("Contents", []))
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        return sorted({n.removesuffix(SEGMENTS) for n in names if n and STAGING_MARKER not in n})

    async def staged(self) -> Sequence[tuple[str, Stat]]:
        """A staged key may be a plain object or segments (`<key>~tmp-<id>.seg/...`): segments
        are summed into one entry, with the newest segment's time."""
        found: dict[str, Stat] = {}
        for obj in await self._objects(self.prefix):
            key = obj["Key"][len(self.prefix):]
            if SEGMENTS + "/" in key:
                key = key.rsplit(SEGMENTS + "/", 1)[0]
            if not is_staged_leaf(key.rsplit("/", 1)[-1]):
                continue
            seen = found.get(key, Stat(0, 0.0))
            found[key] = Stat(seen.size + obj["Size"],
                              max(seen.mtime, obj["LastModified"].timestamp()))
        return sorted(found.items())

    def redirect_url(self, key: str) -> str | None:
        if self.redirect_ttl <= 0:
            return None
        url: str = self.client.generate_presigned_url(  # signs locally, no request
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)},
            ExpiresIn=self.redirect_ttl)
        return url
