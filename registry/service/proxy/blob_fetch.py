"""One upstream fetch per missing blob, shared by every request that wants it meanwhile.

The fetch runs as its own task (a client that goes away does not stop it, so the cache still
fills). Bytes go to a staged key while a hasher follows them; the blob is committed, and linked
into the repositories that asked, only when its sha256 is the digest asked for. Where the
upstream serves ranges the bytes come in parallel segments (segments.py), else as one stream; a
body cut short is resumed with `Range` under the transfer client's retry policy; a lie (wrong
bytes, too many) deletes the staged key, so nothing is stored and the next request asks upstream
again.

Requests are served while the bytes arrive: each subscribes to the byte range it wants and gets
its pieces through a bounded queue (QUEUE_PIECES pieces, at most 32 MiB: a slow client slows
the fetch rather than filling memory, a brief stall does not). The blob's last piece is held
back until the digest is verified, so no response for the whole blob completes unless the blob
is good; on a lie the responses are cut off, and their clients' own checks fail. A request that
arrives just after its first byte went past (another client started the same pull a moment
earlier) is replayed the last REPLAY_BYTES the fetch passed on, then follows it live; one that
arrives later waits for the commit and is then served from the cache like any hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

from registry.digests import Digest, Hasher
from registry.service import paths
from registry.service.errors import RegistryError
from registry.service.proxy.manifests import UPSTREAM_ERRORS, upstream_failed
from registry.service.proxy.segments import SegmentPlan, ordered_pieces, total_size
from registry.service.proxy.upstream import UpstreamClient
from registry.service.registry import Registry
from registry.transfer.errors import RegistryNotFound, TransferError
from registry.transfer.retry import RetryPolicy, ShortRead
from registry.transfer.session import Piece, Reply

log = logging.getLogger("ferry.registry.proxy")
QUEUE_PIECES = 32  # per subscriber; a piece is at most 1 MiB (plain_socket.BODY_PIECE)
SUBSCRIBER_STALL = 30.0  # seconds a request may leave its full queue unread
REPLAY_BYTES = 32 * 1024 * 1024  # the latest bytes passed on, kept for requests that join late
_END = object()


class Subscription:
    """One request's share of a fetch: bytes [start, end] (end inclusive; None: to the end)."""

    def __init__(self, fetch: BlobFetch, start: int, end: int | None) -> None:
        self.fetch = fetch
        self.start = start
        self.end = end
        self.queue: asyncio.Queue[object] = asyncio.Queue(maxsize=QUEUE_PIECES)
        self.backlog: deque[object] = deque()  # replayed pieces, read before the queue
        self.error: RegistryError | None = None
        self.closed = False

    async def next(self) -> Piece | None:
        """The next piece, None at the end; raises the fetch's error when it failed."""
        item = self.backlog.popleft() if self.backlog else await self.queue.get()
        if self.error is not None:
            raise self.error
        return None if item is _END else item  # type: ignore[return-value]

    def close(self) -> None:
        """Leave: the fetch stops feeding this request (and is unblocked if it waited on it)."""
        self.closed = True
        self.fetch.subscribers.discard(self)
        self.backlog.clear()
        while not self.queue.empty():
            self.queue.get_nowait()


class BlobFetch:
    def __init__(self, registry: Registry, client: UpstreamClient, repo: str, digest: Digest,
                 retry: RetryPolicy) -> None:
        self.registry = registry
        self.client = client
        self.digest = digest
        self.retry = retry
        self.segment = client.config.segment_bytes
        self.window = client.config.segment_window
        self.repos = {repo}  # linked to the blob once it is committed
        self.size: int | None = None  # from the upstream's Content-Length
        self.received = 0  # bytes taken from upstream
        self.sent = 0  # bytes passed to subscribers (all but the held-back last piece)
        self.subscribers: set[Subscription] = set()
        self.ready = asyncio.Event()  # the size is known, or the fetch failed
        self.done = asyncio.Event()
        self.error: RegistryError | None = None
        self._held: Piece | None = None
        self._joinable = True  # False once the last piece went out
        self._recent: deque[tuple[int, Piece]] = deque()  # (offset, piece) of the latest sent
        self._recent_bytes = 0

    def subscribe(self, start: int, end: int | None) -> Subscription | None:
        """A share from `start`: live, after a replay of what went by when the replay still
        holds it; None when those bytes went by for good."""
        if not self._joinable or self.done.is_set():
            return None
        subscription = Subscription(self, start, end)
        if start < self.sent:
            if not self._recent or self._recent[0][0] > start:
                return None
            for offset, piece in self._recent:
                low = max(offset, start)
                high = offset + len(piece) if end is None else min(offset + len(piece), end + 1)
                if low < high:
                    subscription.backlog.append(piece[low - offset:high - offset])
            if end is not None and end < self.sent:  # all of it was replayed
                subscription.backlog.append(_END)
                return subscription
        self.subscribers.add(subscription)
        return subscription

    async def run(self) -> None:
        if await self.registry.store.stat(paths.blob(self.digest)) is not None:
            await self._stored_meanwhile()
            return
        staged = paths.staging(paths.blob(self.digest), uuid.uuid4().hex)
        hasher = Hasher()
        writes: asyncio.Queue[object] = asyncio.Queue(maxsize=QUEUE_PIECES)
        # A task of its own: the disk write and hash of one piece overlap the reading and
        # relaying of the next, instead of stalling both on every thread hop.
        writer = asyncio.create_task(self.registry.store.append(
            staged, _drain(writes), observe=hasher.update))
        try:
            await self._download(writes, writer)
            await _put(writes, _END, writer)
            await writer
            self._verify(hasher)
            # Verified: the clients may have their last bytes now; they need not wait for the
            # fsync and rename that make the blob durable here.
            if self._held is not None:
                await self._broadcast(self._held)
            await self._finish()
            await self.registry.store.commit(paths.blob(self.digest), staged)
            for repo in sorted(self.repos):
                await self.registry.blobs.link(repo, self.digest)
        except BaseException as exc:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.registry.store.delete(staged)
            self._fail(self._wire_error(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.ready.set()
            self.done.set()

    async def _stored_meanwhile(self) -> None:
        """The blob was committed (an earlier fetch, or a push) between the caller's cache
        check and this start: fetch nothing, but link it (the callers do) only once the
        upstream confirms it serves this digest here, so no private blob leaks."""
        try:
            await self.retry.run("checking the blob", lambda _n: self.client.blob_size(
                min(self.repos), self.digest))
        except BaseException as exc:
            self._fail(self._wire_error(exc))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._joinable = False
            self.ready.set()
            self.done.set()

    def _wire_error(self, exc: BaseException) -> RegistryError:
        if isinstance(exc, RegistryError):
            return exc
        if isinstance(exc, RegistryNotFound):
            return RegistryError("BLOB_UNKNOWN", detail={"digest": str(self.digest)})
        if isinstance(exc, UPSTREAM_ERRORS):
            log.warning("fetching %s upstream failed: %s", self.digest, exc)
            return upstream_failed(self.client, exc)
        return RegistryError("UPSTREAM_FAILED", "the upstream fetch was interrupted")

    def _verify(self, hasher: Hasher) -> None:
        actual = hasher.digest()
        if actual != self.digest or (self.size is not None and hasher.size != self.size):
            raise RegistryError("UPSTREAM_FAILED", f"upstream {self.client.upstream.shown} sent "
                                f"bytes whose digest is {actual}, not {self.digest}; "
                                "nothing was stored")

    async def _download(self, writes: asyncio.Queue[object], writer: asyncio.Task[int]) -> None:
        """In parallel segments when the upstream serves ranges, else as one resumed stream."""
        repo = next(iter(self.repos))
        first = await self.retry.run(f"fetching {self.digest}", lambda _n: (
            self.client.open_blob_start(repo, self.digest, self.segment)))
        size = total_size(first) if first.status == 206 else None
        if size is None:
            pending = [first] if first.status == 200 else []
            if not pending:  # a range we cannot read: start over with one plain GET
                await first.aclose()
            await self.retry.run(f"fetching {self.digest}", lambda _n: self._attempt(
                writes, writer, pending.pop() if pending else None))
            return
        self._set_size(size)
        plan = SegmentPlan(self.client, repo, self.digest, size, self.segment, self.window,
                           self.retry)
        async for chunk in ordered_pieces(plan, first):
            await self._take(chunk, writes, writer)

    async def _attempt(self, writes: asyncio.Queue[object], writer: asyncio.Task[int],
                       reply: Reply | None) -> None:
        """One plain stream of the blob from what was received so far."""
        if reply is None:
            reply = await self.client.open_blob(next(iter(self.repos)), self.digest,
                                                self.received)
        try:
            if self.received == 0:
                length = reply.response.headers.get("content-length", "")
                self._set_size(int(length) if length.isdigit() else None)
            async for chunk in reply.pieces():
                if chunk:
                    await self._take(chunk, writes, writer)
        finally:
            await reply.aclose()
        if self.size is not None and self.received < self.size:
            raise ShortRead(f"the upstream's body for {self.digest} ended "
                            f"{self.size - self.received} bytes early")

    def _set_size(self, size: int | None) -> None:
        self.size = size
        limit = self.registry.uploads.max_blob_bytes
        if limit and size is not None and size > limit:
            raise RegistryError("BLOB_TOO_LARGE", f"blob exceeds the limit of {limit} bytes",
                                detail={"limit": limit})
        self.ready.set()

    async def _take(self, chunk: Piece, writes: asyncio.Queue[object],
                    writer: asyncio.Task[int]) -> None:
        """Pass on the previous piece and hold this one (the last is released once verified),
        and queue it for the writer."""
        limit = self.registry.uploads.max_blob_bytes
        total = self.received + len(chunk)
        if (self.size is not None and total > self.size) or (limit and total > limit):
            raise TransferError(f"the upstream sent more bytes for {self.digest} than it "
                                "announced")
        if self._held is not None:
            await self._broadcast(self._held)
        self._held = chunk
        self.received = total
        await _put(writes, chunk, writer)

    async def _broadcast(self, chunk: Piece) -> None:
        begin, finish = self.sent, self.sent + len(chunk)
        # Counted as sent, and kept for replay, before any delivery awaits: a request joining
        # meanwhile is not in this round, so it gets this piece from the replay instead.
        self.sent = finish
        self._recent.append((begin, chunk))
        self._recent_bytes += len(chunk)
        while self._recent_bytes - len(self._recent[0][1]) >= REPLAY_BYTES:
            self._recent_bytes -= len(self._recent.popleft()[1])
        for sub in list(self.subscribers):
            if sub.closed:
                continue
            low = max(begin, sub.start)
            high = finish if sub.end is None else min(finish, sub.end + 1)
            if low < high:
                piece = chunk if (low, high) == (begin, finish) else chunk[low - begin:high - begin]
                await self._deliver(sub, piece)
            if sub.end is not None and finish > sub.end and not sub.closed:
                await self._deliver(sub, _END)
                self.subscribers.discard(sub)

    async def _finish(self) -> None:
        self._joinable = False
        self._recent.clear()  # nobody joins any more: let the replay's memory go
        for sub in list(self.subscribers):
            if not sub.closed:
                await self._deliver(sub, _END)
        self.subscribers.clear()

    async def _deliver(self, sub: Subscription, item: object) -> None:
        """Queue `item` for one request; a request that reads nothing for SUBSCRIBER_STALL
        seconds is dropped, so one stalled client cannot hold the fetch (and everyone else)."""
        if not sub.queue.full():  # the usual case: no timer, no task per piece
            sub.queue.put_nowait(item)
            return
        try:
            async with asyncio.timeout(SUBSCRIBER_STALL):  # no task per wait (as wait_for
                await sub.queue.put(item)  # makes on 3.11): a slow client fills it every piece
        except TimeoutError:
            log.warning("dropping a request for %s that stopped reading", self.digest)
            sub.error = RegistryError("UPSTREAM_FAILED", "the client stopped reading")
            sub.close()
            sub.queue.put_nowait(_END)  # if it ever reads again, it learns why it was dropped

    def _fail(self, error: RegistryError) -> None:
        self.error = error
        self._joinable = False
        self._recent.clear()
        for sub in list(self.subscribers):
            sub.error = error
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(_END)
        self.subscribers.clear()


async def _drain(writes: asyncio.Queue[object]) -> AsyncIterator[Piece]:
    while (item := await writes.get()) is not _END:
        yield item  # type: ignore[misc]


async def _put(writes: asyncio.Queue[object], item: object, writer: asyncio.Task[int]) -> None:
    """Queue a piece for the writer; if the writer fails meanwhile, raise its error instead of
    waiting forever on a full queue."""
    if not writes.full() and not writer.done():
        writes.put_nowait(item)
        return
    put = asyncio.ensure_future(writes.put(item))
    await asyncio.wait({put, writer}, return_when=asyncio.FIRST_COMPLETED)
    if not put.done():
        put.cancel()
        writer.result()  # the writer's own error
        raise RuntimeError("the blob writer stopped before the blob ended")


class BlobFetches:
    """The fetches running now, one per digest."""

    def __init__(self, registry: Registry, retry: RetryPolicy,
                 on_stored: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.retry = retry
        self.on_stored = on_stored
        self._running: dict[Digest, BlobFetch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, client: UpstreamClient, repo: str, digest: Digest) -> BlobFetch:
        """The running fetch of `digest` (joined), or a new one."""
        fetch = self._running.get(digest)
        if fetch is not None and not fetch.done.is_set():
            fetch.repos.add(repo)
            return fetch
        fetch = BlobFetch(self.registry, client, repo, digest, self.retry)
        self._running[digest] = fetch
        task = asyncio.create_task(fetch.run(), name=f"proxy-fetch-{digest.short}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(t, fetch))
        return fetch

    def _ended(self, task: asyncio.Task[None], fetch: BlobFetch) -> None:
        self._tasks.discard(task)
        if self._running.get(fetch.digest) is fetch:
            del self._running[fetch.digest]
        if fetch.error is None and self.on_stored is not None:
            self.on_stored()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
