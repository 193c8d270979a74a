"""Push: every blob the registry lacks (mounted when possible, else chunked), manifest last.

Per blob: `HEAD` (present: done); a cross-repository mount when the layer names its source
(`from`) or another local model of the same registry uses it (201: done); else an upload.
A small blob (up to `small_blob_max`) with no mount source goes up whole in one request,
`POST ?digest=` with its bytes (the OCI spec's optional single-POST push): a model's many small
blobs then cost two requests each, not four, and a failure simply sends the blob again. A
registry without single-POST pushes opens a session instead (202: the bytes follow as below,
as with every other registry) or refuses a POST with a body (400/405/413/415: the blob takes
the usual path). Everything else gets an upload session, `PATCH`ed in chunks with
`Content-Range`. After a failed chunk the client asks the registry how far the session got
(`GET` on the upload URL) and continues from there, instead of starting over. `PUT ?digest=`
closes the session, and the manifest goes up last, byte-exact.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiofiles
import httpx

from registry.digests import Digest
from registry.errors import InvalidName, NotFound
from registry.manifests import Descriptor, parse_manifest
from registry.names import Name
from registry.store import Store
from registry.transfer.client import RegistryClient, TransferOptions, parse_target
from registry.transfer.errors import TransferError, TransientStatus, UpstreamError
from registry.transfer.progress import progress
from registry.transfer.session import Reply
from registry.transfer.tasks import run_all

# How a registry without single-POST pushes may refuse a POST that carries a blob's bytes.
_NO_SINGLE_POST = (400, 405, 413, 415)

Progress = Callable[[dict[str, Any]], None]
_READ = 1024 * 1024
_RANGE = re.compile(r"(?:bytes=)?(\d+)-(\d+)")


async def push(model: str, store: Store, options: TransferOptions, report: Progress) -> None:
    """Push `model` from `store` to its registry, calling `report` with progress messages."""
    name, base = parse_target(model, options.insecure)
    report(progress("retrieving manifest"))
    raw = await asyncio.to_thread(store.read_manifest, name)
    manifest = parse_manifest(raw)
    if manifest.is_index:
        raise NotFound(f"model '{name.display_shortest()}' is an index; ferry pushes models")
    blobs = list({d.digest: d for d in manifest.references()}.values())
    async with RegistryClient(name, base, options) as client:
        streams = asyncio.Semaphore(options.max_streams)
        mounts = await asyncio.to_thread(local_mounts, store, name)
        await run_all(BlobPush(client, store, desc, streams, report, mounts).run()
                      for desc in blobs)
        report(progress("pushing manifest"))
        await options.retry.run("pushing manifest", lambda _n: _put_manifest(
            client, name, raw, manifest.media_type))
    report(progress("success"))


async def _put_manifest(client: RegistryClient, name: Name, raw: bytes, media_type: str) -> None:
    reply = await client.request("PUT", client.url(f"manifests/{name.tag}"), content=raw,
                                 headers={"Content-Type": media_type}, ok=(200, 201))
    await reply.release()


def local_mounts(store: Store, name: Name) -> dict[Digest, str]:
    """Blob digest -> another repository on `name`'s registry whose local model uses it (the
    first such model listed), read once per push rather than once per blob."""
    found: dict[Digest, str] = {}
    for entry in store.list_models():
        if entry.name.host.lower() != name.host.lower() or \
                entry.name.repository.lower() == name.repository.lower():
            continue
        try:
            digests = entry.manifest().blob_digests()
        except ValueError:
            continue
        for digest in digests:
            found.setdefault(digest, entry.name.repository)
    return found


def mount_source(name: Name, desc: Descriptor, mounts: dict[Digest, str]) -> str | None:
    """A repository on the same registry that should already hold this blob, if we know one:
    the layer's own `from`, else a local model's (`local_mounts`)."""
    if desc.from_:
        try:
            source = Name.parse_valid(desc.from_)
        except InvalidName:
            source = None
        if source is not None and source.host.lower() == name.host.lower():
            return source.repository
    return mounts.get(desc.digest)


class BlobPush:
    """One blob: skip, mount, or upload (whole when small, else in chunks that survive a
    failed PATCH)."""

    def __init__(self, client: RegistryClient, store: Store, desc: Descriptor,
                 streams: asyncio.Semaphore, report: Progress,
                 mounts: dict[Digest, str] | None = None) -> None:
        self.client = client
        self.mounts = mounts or {}
        self.store = store
        self.desc = desc
        self.streams = streams
        self.report = report
        self.status = f"pushing {desc.digest.short}"
        self.path = store.blob_path(desc.digest)
        self.sent = 0
        self.location = httpx.URL()
        self._last_report = 0.0

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= self.client.options.progress_interval:
            self._last_report = now
            self.report(progress(self.status, str(self.desc.digest), self.desc.size, self.sent))

    async def run(self) -> None:
        if not await asyncio.to_thread(self.path.is_file):
            raise NotFound(f'blob "{self.desc.digest}" of the manifest is not in the store')
        self._progress(force=True)
        retry = self.client.options.retry
        async with self.streams:
            if await retry.run(self.status, lambda _n: self._exists()):
                return self._done()
            whole = self.desc.size <= self.client.options.small_blob_max and \
                mount_source(self.client.name, self.desc, self.mounts) is None
            location = await retry.run(self.status, lambda _n: self._whole() if whole
                                       else self._start())
            if location is None:
                return self._done()
            location = await self._upload(location)
            await retry.run(self.status, lambda _n: self._finish(location))
        self._done()

    def _done(self) -> None:
        self.sent = self.desc.size
        self._progress(force=True)

    async def _exists(self) -> bool:
        url = self.client.url(f"blobs/{self.desc.digest}")
        reply = await self.client.request("HEAD", url, ok=(200, 404))
        await reply.release()
        return reply.status == 200

    async def _whole(self) -> httpx.URL | None:
        """A small blob in one request, `POST ?digest=` with its bytes: None once stored (201).
        A registry without single-POST pushes gets the usual flow: its session (202), or a
        bodyless POST when it refuses one with a body."""
        data = await self._read_whole()
        url = self.client.url("blobs/uploads/").copy_merge_params({"digest": str(self.desc.digest)})
        try:
            reply = await self.client.request(
                "POST", url, ok=(201, 202), content=data,
                headers={"Content-Type": "application/octet-stream"})
        except UpstreamError as exc:
            if isinstance(exc, TransientStatus) or exc.status not in _NO_SINGLE_POST:
                raise
            return await self._start()
        await reply.release()
        return None if reply.status == 201 else _location(reply)

    async def _read_whole(self) -> bytes:
        data = await asyncio.to_thread(self.path.read_bytes)
        if len(data) != self.desc.size:
            raise TransferError(f"the local copy of blob {self.desc.digest} has {len(data)} "
                                f"bytes, its manifest says {self.desc.size}: pull or create "
                                "the model again before pushing it")
        return data

    async def _start(self) -> httpx.URL | None:
        """Open an upload session (or mount); None when the blob is already in place."""
        params: dict[str, str] = {}
        source = mount_source(self.client.name, self.desc, self.mounts)
        if source is not None:
            params = {"mount": str(self.desc.digest), "from": source}
        url = self.client.url("blobs/uploads/").copy_merge_params(params)
        reply = await self.client.request("POST", url, ok=(201, 202))
        await reply.release()
        if reply.status == 201 and source is not None:
            return None
        return _location(reply)

    async def _upload(self, location: httpx.URL) -> httpx.URL:
        """PATCH the blob chunk by chunk; each chunk retried from the session's real offset."""
        self.location = location
        offset = 0
        while offset < self.desc.size:
            stop = min(offset + self.client.options.chunk_size, self.desc.size)
            offset = await self.client.options.retry.run(
                self.status, functools.partial(self._chunk, start=offset, stop=stop))
            self.sent = offset
            self._progress()
        return self.location

    async def _chunk(self, attempt: int, *, start: int, stop: int) -> int:
        """Send bytes [start, stop); on a retry, first learn where the session really is."""
        if attempt > 1:
            start, self.location = await self._session_offset(self.location)
            if start >= stop:
                return start
        reached, self.location = await self._patch(self.location, start, stop)
        return reached

    async def _patch(self, location: httpx.URL, start: int, stop: int) -> tuple[int, httpx.URL]:
        headers = {"Content-Type": "application/octet-stream",
                   "Content-Length": str(stop - start), "Content-Range": f"{start}-{stop - 1}"}
        reply = await self.client.request(
            "PATCH", location, headers=headers, ok=(202, 204),
            content=lambda: self._read(start, stop))
        await reply.release()
        reached = _range_end(reply.response.headers.get("range"))
        return (stop if reached is None else reached), _location(reply, location)

    async def _session_offset(self, location: httpx.URL) -> tuple[int, httpx.URL]:
        """Ask the registry how many bytes the session holds (after a failed chunk)."""
        reply = await self.client.request("GET", location, ok=(200, 204))
        await reply.release()
        reached = _range_end(reply.response.headers.get("range"))
        return (reached or 0), _location(reply, location)

    async def _read(self, start: int, stop: int) -> AsyncIterator[bytes]:
        async with aiofiles.open(self.path, "rb") as fh:
            await fh.seek(start)
            position = start
            while position < stop:
                data = await fh.read(min(_READ, stop - position))
                if not data:
                    raise UpstreamError(0, f"blob {self.desc.digest} shrank while pushing")
                position += len(data)
                yield data
                self.sent = position  # sent, not yet acknowledged: a failed chunk rewinds it
                self._progress()

    async def _finish(self, location: httpx.URL) -> None:
        url = location.copy_merge_params({"digest": str(self.desc.digest)})
        reply = await self.client.request("PUT", url, ok=(201, 204, 200),
                                          headers={"Content-Type": "application/octet-stream",
                                                   "Content-Length": "0"})
        await reply.release()


def _location(reply: Reply, fallback: httpx.URL | None = None) -> httpx.URL:
    """The next upload URL: `Docker-Upload-Location`, else `Location`, relative to the reply."""
    headers = reply.response.headers
    value = headers.get("docker-upload-location") or headers.get("location")
    if not value:
        if fallback is not None:
            return fallback
        raise UpstreamError(reply.status, "the registry gave no upload location", str(reply.url))
    return reply.url.join(value)


def _range_end(value: str | None) -> int | None:
    """`0-N` (or `bytes=0-N`) from a Range header: the session holds N+1 bytes."""
    if not value:
        return None
    match = _RANGE.search(value)
    return int(match.group(2)) + 1 if match else None
