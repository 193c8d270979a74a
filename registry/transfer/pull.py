"""Pull: manifest, then every missing blob in parallel Range parts, verified, manifest last.

Blobs already in the store are skipped. A small blob (<= 4 MiB) is fetched whole into memory
and written once. A larger one is split into parts (size/64 clamped to [16 MB, 256 MB], small
so the in-order hasher stays close behind) fetched with `Range` into its `-partial` file; all
blobs and parts share one bound of `max_streams` concurrent bodies. Progress is checkpointed
per part, so a pull that is cancelled, killed or cut off resumes from what is on disk. A blob
gets its final name only after its sha256 and size match; the manifest is written last,
atomically; then the blobs only the replaced manifest used are removed (unless noprune).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from registry import media_types as mt
from registry.digests import Digest
from registry.errors import DigestMismatch, FerryError, InvalidManifest, NotFound
from registry.manifests import Descriptor, Manifest, parse_manifest
from registry.names import Name
from registry.store import Store
from registry.transfer.client import RegistryClient, TransferOptions, parse_target
from registry.transfer.errors import TransferError
from registry.transfer.mirrors import pull_sources
from registry.transfer.partial import OrderedHasher, Part, PartialBlob
from registry.transfer.progress import progress
from registry.transfer.retry import ShortRead
from registry.transfer.session import Piece, Reply
from registry.transfer.tasks import in_thread, run_all

Progress = Callable[[dict[str, Any]], None]
log = logging.getLogger("ferry.transfer")
_WRITE_BATCH = 1024 * 1024


class ManifestError(TransferError):
    """Fetching or reading the manifest failed (Ollama's "pull model manifest: ...")."""


class ManifestNotFound(NotFound, ManifestError):
    """The registry has no such model or tag (a 404 at the API edge)."""


async def pull(model: str, store: Store, options: TransferOptions, report: Progress) -> None:
    """Pull `model` into `store`, calling `report` with Ollama's progress messages.

    The model's host's mirrors (options.mirrors) are tried first, then the host itself unless
    `mirrors_only`; whichever serves it, the model is stored under its own name."""
    name, base = parse_target(model, options.insecure)
    sources = pull_sources(name, base, options)
    for index, (source, source_options) in enumerate(sources):
        try:
            manifest = await _download(name, source, source_options, store, report)
            break
        except (FerryError, httpx.HTTPError) as exc:
            if index == len(sources) - 1:
                raise
            log.warning("pulling %s from %s failed (%s); trying %s", name, source, exc,
                        sources[index + 1][0])
    report(progress("verifying sha256 digest"))
    report(progress("writing manifest"))
    previous = _current_manifest(store, name)
    await asyncio.to_thread(store.write_manifest, name, manifest.raw)
    if previous is not None and previous != manifest.raw and not options.noprune:
        report(progress("removing unused layers"))
        await asyncio.to_thread(store.remove_unused_after_replace, previous)
    report(progress("success"))


async def _download(name: Name, base: httpx.URL, options: TransferOptions, store: Store,
                    report: Progress) -> Manifest:
    """The manifest from `base`, and every blob of it into `store` (the manifest not yet)."""
    async with RegistryClient(name, base, options) as client:
        report(progress("pulling manifest"))
        manifest = await _fetch_manifest(client, name)
        blobs = _unique_blobs(manifest)
        streams = Streams(options.max_streams)
        # Blobs in flight (each holds a partial file and a hashing thread) are bounded too.
        slots = asyncio.Semaphore(2 * options.max_streams)
        await run_all(BlobPull(client, store, desc, streams, report).run(slots)
                      for desc in blobs)
    return manifest


class Streams:
    """The bound on concurrent bodies, `total`; parts of large blobs may hold only 3/4 of it.

    Small blobs are latency-bound and large ones throughput-bound, so they overlap well; the
    reserve keeps a large blob's parts from queueing every small blob behind them.
    """

    def __init__(self, total: int) -> None:
        self.any = asyncio.Semaphore(total)
        self.large = asyncio.Semaphore(max(1, total - total // 4))

    @contextlib.asynccontextmanager
    async def for_part(self) -> AsyncIterator[None]:
        async with self.large, self.any:
            yield


_claims: dict[tuple[int, str, Digest], tuple[asyncio.Lock, int]] = {}


@contextlib.asynccontextmanager
async def _claim(store: Store, digest: Digest) -> AsyncIterator[None]:
    """One download per blob per store at a time: two pulls sharing a blob (or the same model
    pulled twice at once) must not write the same `-partial` file together."""
    key = (id(asyncio.get_running_loop()), str(store.root), digest)
    lock, users = _claims.get(key, (asyncio.Lock(), 0))
    _claims[key] = (lock, users + 1)
    try:
        async with lock:
            yield
    finally:
        lock, users = _claims[key]
        if users == 1:
            del _claims[key]
        else:
            _claims[key] = (lock, users - 1)


def _current_manifest(store: Store, name: Name) -> bytes | None:
    with contextlib.suppress(NotFound):
        return store.read_manifest(name)
    return None


def _unique_blobs(manifest: Manifest) -> list[Descriptor]:
    seen: dict[Digest, Descriptor] = {}
    for desc in manifest.references():
        seen.setdefault(desc.digest, desc)
    return list(seen.values())


async def _fetch_manifest(client: RegistryClient, name: Name) -> Manifest:
    reference = name.digest or name.tag
    try:
        raw, content_type = await client.options.retry.run(
            "fetching the manifest", lambda _n: _get_manifest(client, reference))
        manifest = parse_manifest(raw, content_type, client.options.max_manifest_bytes)
    except (FerryError, httpx.HTTPError) as exc:
        kind = ManifestNotFound if isinstance(exc, NotFound) else ManifestError
        raise kind(f"pull model manifest: {exc}") from exc
    if name.digest and Digest.of(raw) != Digest.parse(name.digest):
        mismatch = DigestMismatch(name.digest, str(Digest.of(raw)))
        raise ManifestError(f"pull model manifest: {mismatch}")
    if manifest.is_index:
        raise ManifestError("pull model manifest: the reference is an index of several "
                            "manifests; name one of them by digest")
    return manifest


async def _get_manifest(client: RegistryClient, reference: str) -> tuple[bytes, str | None]:
    reply = await client.request("GET", client.url(f"manifests/{reference}"),
                                 headers={"Accept": mt.MANIFEST_ACCEPT})
    body = await reply.read_capped(client.options.max_manifest_bytes, "manifest")
    claimed = reply.response.headers.get("docker-content-digest")
    if claimed and Digest.is_valid(claimed) and Digest.parse(claimed) != Digest.of(body):
        raise InvalidManifest(f"Docker-Content-Digest {claimed} does not match the body")
    return body, reply.response.headers.get("content-type")


class BlobPull:
    """One blob: skip if present, else fetch its parts, hash in order, verify, publish."""

    def __init__(self, client: RegistryClient, store: Store, desc: Descriptor,
                 streams: Streams, report: Progress) -> None:
        self.client = client
        self.store = store
        self.desc = desc
        self.streams = streams
        self.report = report
        self.status = f"pulling {desc.digest.short}"
        self.parts: list[Part] = []
        self._last_report = 0.0
        self._hasher: OrderedHasher | None = None

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= self.client.options.progress_interval:
            self._last_report = now
            done = sum(p.completed for p in self.parts) if self.parts else self.desc.size
            self.report(progress(self.status, str(self.desc.digest), self.desc.size, done))

    async def run(self, slots: asyncio.Semaphore) -> None:
        async with slots, _claim(self.store, self.desc.digest):
            await self._run()  # a second pull of this blob waits, then finds it present

    async def _run(self) -> None:
        if await asyncio.to_thread(self._already_present):
            self._progress(force=True)
            return
        if self.desc.size <= self.client.options.small_blob_max:
            await self._fetch_small()
            return
        partial = PartialBlob(self.store.blobs_dir, self.desc)
        size = self.client.options.part_size(self.desc.size)
        self.parts = await asyncio.to_thread(partial.load_parts, size)
        await asyncio.to_thread(partial.open, self.parts)
        self._progress(force=True)
        hasher = self._hasher = OrderedHasher(partial.path, self.parts, self.desc.size)
        hashing = in_thread(hasher.run, f"hash-{self.desc.digest.short}")
        try:
            await run_all(self._fetch_part(partial, part) for part in self.parts
                          if part.remaining)
            result = await hashing
        finally:
            hasher.stop()
            await asyncio.gather(hashing, return_exceptions=True)
            partial.close()
        self._progress(force=True)
        await asyncio.to_thread(self._publish, partial, result)

    async def _fetch_small(self) -> None:
        """A small blob: one GET into memory, verified and written once (no part state)."""
        part = Part(0, 0, self.desc.size)
        self.parts = [part]
        self._progress(force=True)
        data = await self.client.options.retry.run(self.status, lambda _n: self._get_small())
        await asyncio.to_thread(self._write_small, data)
        part.completed = part.size
        self._progress(force=True)

    async def _get_small(self) -> bytes:
        async with self.streams.any:
            reply = await self.client.request("GET", self.client.url(f"blobs/{self.desc.digest}"),
                                              headers={"Accept-Encoding": "identity"})
            try:
                body = bytearray()
                async for chunk in reply.pieces():
                    body += chunk
                    if len(body) > self.desc.size:
                        raise TransferError(f"{self.status}: the registry sent more bytes "
                                            f"than the manifest's {self.desc.size}")
            finally:
                await reply.aclose()
        if len(body) < self.desc.size:
            raise ShortRead(f"{self.status}: the body ended {self.desc.size - len(body)} bytes "
                            "early")
        return bytes(body)

    def _write_small(self, data: bytes) -> None:
        self.store.blob_writer(self.desc.digest, self.desc.size).write_all(data)

    def _already_present(self) -> bool:
        path = self.store.blob_path(self.desc.digest)
        try:
            return path.stat().st_size == self.desc.size
        except FileNotFoundError:
            return False

    def _publish(self, partial: PartialBlob, result: tuple[Digest, int] | None) -> None:
        digest, size = result if result is not None else (None, -1)
        if digest != self.desc.digest or size != self.desc.size:
            partial.remove()
            raise DigestMismatch(str(self.desc.digest), str(digest))
        partial.finish()
        self.store.adopt_blob(partial.path, self.desc.digest)

    async def _fetch_part(self, partial: PartialBlob, part: Part) -> None:
        async def attempt(_n: int) -> None:
            async with self.streams.for_part():
                await self._stream_part(partial, part)

        await self.client.options.retry.run(self.status, attempt)

    async def _stream_part(self, partial: PartialBlob, part: Part) -> None:
        if not part.remaining:
            return
        last = part.offset + part.size - 1
        headers = {"Range": f"bytes={part.next_byte}-{last}", "Accept-Encoding": "identity"}
        reply = await self.client.request("GET", self.client.url(f"blobs/{self.desc.digest}"),
                                          headers=headers, ok=(200, 206))
        try:
            if reply.status == 200 and not (part.next_byte == 0 and part.size == self.desc.size):
                raise TransferError(f"{self.status}: the registry ignored the Range request")
            await self._copy_body(reply, partial, part)
        finally:
            await reply.aclose()
            await asyncio.to_thread(partial.save, part)
        if part.remaining:
            raise ShortRead(f"{self.status}: the body ended {part.remaining} bytes early")

    async def _copy_body(self, reply: Reply, partial: PartialBlob, part: Part) -> None:
        # Chunks are gathered, not concatenated: one pwritev per batch, no copy on the loop.
        batch: list[Piece] = []
        batched = since_checkpoint = 0
        checkpoint = self.client.options.checkpoint_bytes
        try:
            async for chunk in reply.pieces():
                if batched + len(chunk) > part.remaining:
                    raise TransferError(f"{self.status}: the registry sent more bytes than asked")
                batch.append(chunk)
                batched += len(chunk)
                if batched >= _WRITE_BATCH:
                    await asyncio.to_thread(partial.write, batch, part.next_byte)
                    part.completed += batched
                    since_checkpoint += batched
                    batch, batched = [], 0
                    self._after_write()
                    if since_checkpoint >= checkpoint:
                        await asyncio.to_thread(partial.save, part)
                        since_checkpoint = 0
        finally:
            if batch:  # also on cancel: keep what arrived, so a resume does not refetch it
                partial.write(batch, part.next_byte)
                part.completed += batched
                self._after_write()

    def _after_write(self) -> None:
        if self._hasher is not None:
            self._hasher.wake()
        self._progress()
