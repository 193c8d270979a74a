"""`POST /api/pull` and `POST /api/push` (reference 4.2): the transfer client behind Ollama's API.

The transfer runs as a task that reports into a queue; the response streams the queue as NDJSON
(or returns the last message with `"stream": false`). A client that disconnects closes the event
iterator, which cancels the task: a pull keeps its partial blobs for the next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from registry.store import Store
from registry.transfer.client import TransferOptions, parse_target
from registry.transfer.pull import pull
from registry.transfer.push import push
from server.api_errors import APIError, read_json, require_str
from server.api_stream import progress_response

Operation = Callable[[str, Store, TransferOptions, Callable[[dict[str, Any]], None]],
                     Awaitable[None]]
_DONE = object()


class TransferSettings(Protocol):
    """What transfers read of ferry's Settings (ferry/config.py satisfies it)."""

    @property
    def home(self) -> Path: ...
    @property
    def max_transfer_streams(self) -> int: ...
    @property
    def noprune(self) -> bool: ...
    @property
    def max_manifest_bytes(self) -> int: ...
    @property
    def ssl_cert_file(self) -> str: ...
    @property
    def mirrors(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def mirrors_only(self) -> bool: ...


def transfer_options(settings: TransferSettings) -> TransferOptions:
    """The options every pull and push of this server starts from (the app builder stores
    them as `app.state.transfer_options`; a request only chooses `insecure`)."""
    return TransferOptions(home=settings.home, max_streams=settings.max_transfer_streams,
                           noprune=settings.noprune,
                           max_manifest_bytes=settings.max_manifest_bytes,
                           ca_file=settings.ssl_cert_file, mirrors=settings.mirrors,
                           mirrors_only=settings.mirrors_only)


async def run_events(operation: Operation, model: str, store: Store,
                     options: TransferOptions) -> AsyncIterator[dict[str, Any]]:
    """Run a pull or push as a task and yield its progress; closing the iterator cancels it."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def run() -> None:
        try:
            await operation(model, store, options, queue.put_nowait)
        finally:
            queue.put_nowait(_DONE)

    task = asyncio.create_task(run())
    try:
        while (event := await queue.get()) is not _DONE:
            yield event
        await task  # re-raises the operation's error after its last progress line
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _handle(request: Request, operation: Operation) -> Response:
    data = await read_json(request)
    model = require_str(data, "model", "name")
    insecure, stream = data.get("insecure", False), data.get("stream", True)
    if not isinstance(insecure, bool) or not isinstance(stream, bool):
        raise APIError(400, "insecure and stream must be booleans")
    parse_target(model, insecure)  # a bad name or scheme is a 400 before any output
    options = dataclasses.replace(request.app.state.transfer_options, insecure=insecure)
    events = run_events(operation, model, request.app.state.store, options)
    return await progress_response(request, events, stream)


async def pull_handler(request: Request) -> Response:
    return await _handle(request, pull)


async def push_handler(request: Request) -> Response:
    return await _handle(request, push)


routes = [
    Route("/api/pull", pull_handler, methods=["POST"]),
    Route("/api/push", push_handler, methods=["POST"]),
]
