"""`POST /api/create` (reference 2.1, 2.2, 2.4): the request edge of the create pipeline.

Everything that can be checked from the request and the store is checked before the stream
starts (400s, and 503 when MLX is missing); the checkpoint itself is inventoried and validated
in the worker before its first progress line, so those failures are 400s too. The pipeline
runs in a worker thread; a client that disconnects sets its cancel signal, and the response
waits (shielded) for the worker to stop, which happens within one tensor.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from registry.digests import Digest
from registry.names import Name
from registry.store import Store
from registry.upload_sessions import Upload, Uploads
from runner.quant import QuantRuntimeUnavailable, load_mlx
from server.api_errors import APIError, read_json, require_str
from server.api_stream import progress_response
from workflows.create import (
    BaseModel,
    CreateOptions,
    GGUFFiles,
    Source,
    UploadedFiles,
    create,
)
from workflows.create.config_blob import check_requires, parse_info
from workflows.create.errors import CreateError
from workflows.create.stage import is_gguf, parse_files_map, require_blobs
from workflows.create.validate import parse_quantize
from workflows.create.write import CancelSignal, Progress


class CreateLimits(Protocol):
    """The settings create needs (ferry.config.Settings has them; workflows never imports it)."""

    max_create_files: int
    max_metadata_file_bytes: int
    noprune: bool


@dataclass(frozen=True)
class CreateRequest:
    name: Name
    source: Source
    options: CreateOptions

    @property
    def needs_mlx(self) -> bool:
        """Importing a safetensors checkpoint (or a draft) quantizes and validates with MLX."""
        return isinstance(self.source, UploadedFiles) or self.options.draft_dir is not None

    def run(self, store: Store, progress: Progress, cancel: CancelSignal) -> Digest:
        """The whole create, synchronously (a worker thread calls this)."""
        return create(self.name, self.source, self.options, store, progress, cancel)


def parse_request(data: dict[str, Any], store: Store, limits: CreateLimits,
                  uploads: Uploads | None = None) -> CreateRequest:
    """Validate the body against the store; every problem is a CreateError (400). `files` may
    name upload sessions of `uploads` still in progress (`upload:<id>`)."""
    name = Name.parse_valid(require_str(data, "model", "name"))
    info = parse_info(data.get("info"))
    if data.get("remote_host"):
        raise CreateError("remote models are not supported by ferry")
    if data.get("adapters"):
        raise CreateError("adapters are not supported by ferry's create")
    files, pending = parse_files_map(data.get("files") or {}, "files", limits.max_create_files,
                                     uploads)
    draft_files, _ = parse_files_map(data.get("draft_files") or {}, "draft_files",
                                     limits.max_create_files)
    require_blobs(store, {**files, **{f"draft/{k}": v for k, v in draft_files.items()}},
                  limits.max_metadata_file_bytes)
    source = _source(files, pending, data.get("from"), store)
    quantize = _optional_str(data, "quantize") or _optional_str(data, "quantization")
    target_q, draft_q = parse_quantize(quantize, _optional_str(data, "draft_quantize"),
                                       bool(draft_files))
    options = CreateOptions(
        quantize=target_q, draft_quantize=draft_q,
        draft_dir=UploadedFiles(draft_files) if draft_files else None,
        template=_optional_str(data, "template"), system=_optional_str(data, "system"),
        license=_licenses(data.get("license")), parameters=_object(data, "parameters"),
        messages=_messages(data.get("messages")),
        requires=check_requires(r) if (r := _optional_str(data, "requires")) else None,
        noprune=limits.noprune, info=info,
    )
    return CreateRequest(name, source, options)


def _source(files: dict[str, Digest], pending: dict[str, Upload], base: Any,
            store: Store) -> Source:
    """What the model is made from: uploaded safetensors, GGUF files, or an existing model."""
    if files or pending:
        if base not in (None, ""):
            raise CreateError("from cannot be combined with files")
        if pending:  # only *.safetensors files name sessions: a GGUF create is refused below
            if any(_file_kind(store, files).values()):
                raise CreateError("mixed model file types are not supported")
            return UploadedFiles(files, pending)
        return GGUFFiles(files) if any(_file_kind(store, files).values()) else UploadedFiles(files)
    if base in (None, ""):
        raise CreateError("neither files nor from were given; nothing to create")
    if not isinstance(base, str):
        raise CreateError("from must be a string")
    return BaseModel(store.read_manifest(Name.parse_valid(base)))


def _file_kind(store: Store, files: dict[str, Digest]) -> dict[str, bool]:
    """Which files are GGUF; mixing GGUF and safetensors weights is refused."""
    kinds = {rel: is_gguf(store, rel, d) for rel, d in files.items()}
    if any(kinds.values()) and any(rel.endswith(".safetensors") for rel in files):
        raise CreateError("mixed model file types are not supported")
    if any(kinds.values()) and not all(kinds.values()):
        extra = sorted(rel for rel, g in kinds.items() if not g)
        raise CreateError(f"a GGUF create takes only GGUF files; also got {', '.join(extra)}")
    return kinds


def _optional_str(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise CreateError(f"{key} must be a string")
    return value or None


def _object(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise CreateError(f"{key} must be an object")
    return value or None


def _licenses(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    raise CreateError("license must be a string or a list of strings")


def _messages(value: Any) -> list[Any] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
    ):
        raise CreateError("messages must be a list of {role, content} objects")
    return value or None


def _check_runtime() -> None:
    try:
        load_mlx()
    except QuantRuntimeUnavailable as exc:
        raise APIError(503, str(exc)) from exc


async def run_in_worker(job: Callable[[Progress, CancelSignal], Any]
                        ) -> AsyncIterator[dict[str, Any]]:
    """Run `job` in a thread and yield its progress; closing the iterator cancels the job."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancel = threading.Event()

    def emit(event: dict[str, Any]) -> None:
        if not cancel.is_set():
            loop.call_soon_threadsafe(queue.put_nowait, ("event", event))

    def work() -> None:
        try:
            job(emit, cancel)
            outcome: tuple[str, Any] = ("done", None)
        except BaseException as exc:
            outcome = ("error", exc)
        loop.call_soon_threadsafe(queue.put_nowait, outcome)

    worker = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        while True:
            kind, value = await queue.get()
            if kind == "error":
                raise value
            if kind == "done":
                return
            yield value
    finally:
        cancel.set()
        with anyio.CancelScope(shield=True):
            await worker


async def create_model(request: Request) -> Response:
    settings = request.app.state.settings
    store: Store = request.app.state.store
    data = await read_json(request)
    job = await asyncio.to_thread(parse_request, data, store, settings,
                                  getattr(request.app.state, "uploads", None))
    if job.needs_mlx:
        _check_runtime()
    stream = data.get("stream", True) is not False

    def run(progress: Progress, cancel: CancelSignal) -> Digest:
        return job.run(store, progress, cancel)

    return await progress_response(request, run_in_worker(run), stream)


routes = [Route("/api/create", create_model, methods=["POST"])]
