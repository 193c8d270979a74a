"""`POST /api/create` (reference 2.1, 2.2, 2.4): the request edge of the create pipeline.

Everything that can be checked from the request and the store is checked before the stream
starts (400s, and 503 when MLX is missing); the checkpoint itself is inventoried and validated
in the worker before its first progress line, so those failures are 400s too. The pipeline
runs in a worker thread; a client that disconnects sets its cancel signal, and the response
waits (shielded) for the worker to stop, which happens within one tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from registry.digests import Digest
from registry.names import Name
from registry.store import Store
from runner.quant import QuantRuntimeUnavailable, load_mlx
from server.api_errors import APIError, read_json, require_str
from server.api_stream import progress_response
from workflows.create import CreateOptions, create, modelfile_layers, publish
from workflows.create.config_blob import apply_info, check_requires, parse_info
from workflows.create.errors import CreateError
from workflows.create.gguf_import import gguf_layers
from workflows.create.stage import is_gguf, parse_files_map, require_blobs, staged_dir
from workflows.create.validate import parse_quantize
from workflows.create.write import CancelSignal, Progress

_GGUF_QUANTIZE = ("create-time quantization is only supported for safetensors imports; "
                  "quantize GGUF models with llama.cpp tools before importing")


class CreateLimits(Protocol):
    """The settings create needs (ferry.config.Settings has them; workflows never imports it)."""

    max_create_files: int
    max_metadata_file_bytes: int
    noprune: bool


@dataclass(frozen=True)
class CreateRequest:
    name: Name
    files: dict[str, Digest]
    draft_files: dict[str, Digest]
    gguf: bool
    options: CreateOptions

    def run(self, store: Store, progress: Progress, cancel: CancelSignal) -> Digest:
        """The whole create, synchronously (a worker thread calls this)."""
        if self.gguf:
            layers, config = gguf_layers(self.files, store, progress, cancel)
            layers += modelfile_layers(self.options, store)
            apply_info(config, self.options.info or {})
            return publish(self.name, config, layers, store, progress, cancel,
                           self.options.noprune)
        with contextlib.ExitStack() as stack:
            options = self.options
            if self.draft_files:
                draft = stack.enter_context(staged_dir(store, self.draft_files, cancel))
                options = replace(options, draft_dir=draft)
            root = stack.enter_context(staged_dir(store, self.files, cancel)) \
                if self.files else None
            return create(self.name, root, options, store, progress, cancel)


def parse_request(data: dict[str, Any], store: Store, limits: CreateLimits) -> CreateRequest:
    """Validate the body against the store; every problem is a CreateError (400)."""
    name = Name.parse_valid(require_str(data, "model", "name"))
    info = parse_info(data.get("info"))
    if data.get("remote_host"):
        raise CreateError("remote models are not supported by ferry")
    if data.get("adapters"):
        raise CreateError("adapters are not supported by ferry's create")
    files = parse_files_map(data.get("files") or {}, "files", limits.max_create_files)
    draft_files = parse_files_map(data.get("draft_files") or {}, "draft_files",
                                  limits.max_create_files)
    require_blobs(store, {**files, **{f"draft/{k}": v for k, v in draft_files.items()}},
                  limits.max_metadata_file_bytes)
    gguf = _file_kind(store, files)
    base = _base_manifest(data.get("from"), store, bool(files))
    if not files and base is None:
        raise CreateError("neither files nor from were given; nothing to create")
    quantize = _optional_str(data, "quantize") or _optional_str(data, "quantization")
    draft_quantize = _optional_str(data, "draft_quantize")
    if gguf and (quantize or draft_quantize):
        raise CreateError(_GGUF_QUANTIZE)
    if gguf and draft_files:
        raise CreateError("DRAFT needs a safetensors model; GGUF drafts are not supported")
    target_q, draft_q = parse_quantize(quantize, draft_quantize, bool(draft_files))
    if base is not None and target_q is not None:
        raise CreateError("quantize needs files to import; an existing model is not requantized")
    options = CreateOptions(
        quantize=target_q, draft_quantize=draft_q, base_manifest=base,
        template=_optional_str(data, "template"), system=_optional_str(data, "system"),
        license=_licenses(data.get("license")), parameters=_object(data, "parameters"),
        messages=_messages(data.get("messages")),
        requires=check_requires(r) if (r := _optional_str(data, "requires")) else None,
        noprune=limits.noprune, info=info,
    )
    return CreateRequest(name, files, draft_files, gguf, options)


def _file_kind(store: Store, files: dict[str, Digest]) -> bool:
    """True for a GGUF create; mixing GGUF and safetensors weights is refused."""
    kinds = {rel: is_gguf(store, rel, d) for rel, d in files.items()}
    if any(kinds.values()) and any(rel.endswith(".safetensors") for rel in files):
        raise CreateError("mixed model file types are not supported")
    if any(kinds.values()) and not all(kinds.values()):
        extra = sorted(rel for rel, g in kinds.items() if not g)
        raise CreateError(f"a GGUF create takes only GGUF files; also got {', '.join(extra)}")
    return any(kinds.values())


def _base_manifest(source: Any, store: Store, has_files: bool) -> bytes | None:
    if source in (None, ""):
        return None
    if not isinstance(source, str):
        raise CreateError("from must be a string")
    if has_files:
        raise CreateError("from cannot be combined with files")
    return store.read_manifest(Name.parse_valid(source))


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
    job = await asyncio.to_thread(parse_request, data, store, settings)
    if not job.gguf and (job.files or job.draft_files):
        _check_runtime()
    stream = data.get("stream", True) is not False

    def run(progress: Progress, cancel: CancelSignal) -> Digest:
        return job.run(store, progress, cancel)

    return await progress_response(request, run_in_worker(run), stream)


routes = [Route("/api/create", create_model, methods=["POST"])]
