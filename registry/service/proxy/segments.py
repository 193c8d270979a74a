"""A blob fetched upstream as several Range requests at once, yielded in order.

One HTTP stream is often slower than the link (a CDN paces each connection), which is why
`ferry pull` fetches large blobs in parallel parts. The cache does the same, but it must write
and verify the blob front to back (BlobStore appends; the hash runs in order), so segments are
fetched `window` at a time, the first streamed as it arrives and the others buffered until their
turn: memory stays under `window * segment` bytes per blob. Each segment retries on its own,
resuming where it stopped, under the transfer client's retry policy.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from registry.digests import Digest
from registry.service.proxy.upstream import UpstreamClient
from registry.transfer.errors import TransferError
from registry.transfer.retry import RetryPolicy, ShortRead
from registry.transfer.session import Piece, Reply

_CONTENT_RANGE = re.compile(r"^bytes 0-(\d+)/(\d+)$")
_END = object()


@dataclass(frozen=True)
class _Failure:
    error: BaseException


def total_size(reply: Reply) -> int | None:
    """The blob's size from a 206 for bytes from 0 (`Content-Range: bytes 0-N/SIZE`)."""
    match = _CONTENT_RANGE.match(reply.response.headers.get("content-range", "").strip())
    return int(match.group(2)) if match else None


@dataclass(frozen=True)
class SegmentPlan:
    client: UpstreamClient
    repo: str
    digest: Digest
    size: int
    segment: int
    window: int
    retry: RetryPolicy

    def bounds(self) -> list[tuple[int, int]]:
        return [(s, min(s + self.segment, self.size)) for s in range(0, self.size, self.segment)]


async def ordered_pieces(plan: SegmentPlan, first: Reply) -> AsyncIterator[Piece]:
    """The blob's bytes in order; `first` is the open 206 for the first segment."""
    bounds = plan.bounds()
    queues: list[asyncio.Queue[object]] = [asyncio.Queue() for _ in bounds]
    tasks: list[asyncio.Task[None]] = []
    try:
        for index, queue in enumerate(queues):
            while len(tasks) < min(index + plan.window, len(bounds)):
                n = len(tasks)
                tasks.append(asyncio.create_task(_fetch_segment(
                    plan, bounds[n], queues[n], first if n == 0 else None)))
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await first.aclose()  # closed already unless its task never ran


async def _fetch_segment(plan: SegmentPlan, bounds: tuple[int, int],
                         queue: asyncio.Queue[object], first: Reply | None) -> None:
    start, end = bounds
    got = 0
    pending = [first] if first is not None else []

    async def attempt(_n: int) -> None:
        nonlocal got
        if pending:
            reply = pending.pop()
        else:
            reply = await plan.client.open_blob_range(plan.repo, plan.digest, start + got,
                                                      end - 1)
        try:
            if reply.status != 206:
                raise TransferError(f"the upstream answered {reply.status} to a request for "
                                    f"bytes {start + got}-{end - 1} of {plan.digest}")
            async for chunk in reply.pieces():
                if got + len(chunk) > end - start:
                    raise TransferError(f"the upstream sent more bytes of {plan.digest} than "
                                        "it was asked for")
                got += len(chunk)
                queue.put_nowait(chunk)
        finally:
            await reply.aclose()
        if got < end - start:
            raise ShortRead(f"bytes {start}-{end - 1} of {plan.digest} ended "
                            f"{end - start - got} bytes early")

    try:
        await plan.retry.run(f"fetching bytes {start}-{end - 1} of {plan.digest}", attempt)
    except Exception as exc:  # cancellation passes: the consumer is gone
        queue.put_nowait(_Failure(exc))
        return
    queue.put_nowait(_END)
