"""The runner process's HTTP API (docs/runner-protocol.md); the scheduler is its only client.

    GET  /v1/status       {"status": "loading"|"ready", "progress", "context_length", "memory",
                           "compute", "model", "blas", "draft", "prefix_cache"}
    POST /v1/completions  NDJSON: {"content", "done": false}... then the final counters
                          (with "prompt_cached", and "draft_proposed"/"draft_accepted")
    POST /v1/tokenize     {"content"} -> {"tokens"}
    POST /v1/embed        {"input": [str], "truncate", "dimensions", "options"} ->
                          {"embeddings", "prompt_eval_count", "prompt_eval_duration"}

The HTTP server is up before the model is loaded (status "loading"). All MLX work (the load
and every generation) runs on one worker thread, in order, so requests are served one at a
time and MLX never sees two threads. A client that disconnects sets the request's cancel flag,
which the decode loop checks before every token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from registry.store import Store
from runner.constrain import FormatError, GrammarCompiler, TokenConstraint
from runner.embed import Embedder, EmbedError, build_embedder, embedding_dimensions
from runner.generate import ContextError, Done, Generator, fit_prompt, prefill_chunk
from runner.go_template import GoTemplate, TemplateError
from runner.load import LoadedModel, load_model, read_model_files, trim_heap
from runner.logprobs import MAX_TOP, Logprob
from runner.media.assemble import ImageRequest, assemble, bind, is_vision_model, key_images
from runner.media.decode import MediaError
from runner.media.prompt import (
    IMAGE_KEY_BASE,
    ImageSlots,
    encode_marked,
    mark_images,
    new_sentinel,
)
from runner.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache
from runner.sample import Options, OptionsError
from runner.tokenizer import ModelTokenizer, PromptError

log = logging.getLogger("ferry.runner")
_END = object()
THINK_OPEN = "<think>"


class Worker:
    """One daemon thread running submitted jobs in order (daemon: SIGTERM never waits on it)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._loop, name="mlx-worker", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)


@dataclass
class RunnerState:
    name: str
    compute_setting: str
    release: Callable[[], None]
    prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES
    status: str = "loading"
    progress: float = 0.0
    error: str | None = None
    loaded: LoadedModel | None = None
    tokenizer: ModelTokenizer | None = None
    generator: Generator | None = None
    embedder: Embedder | None = None
    grammar: GrammarCompiler | None = None
    worker: Worker = field(default_factory=Worker)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    image_slots: ImageSlots = field(default_factory=ImageSlots)


def blas_library() -> str:
    """"openblas" when an optimized BLAS is mapped into this process, else "reference"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "openblas" if "libopenblas" in maps else "reference"


def load_into(state: RunnerState, store: Store, on_fail: Callable[[str], None]) -> None:
    def progress(fraction: float) -> None:
        state.progress = fraction

    try:
        # the tokenizer first: its parse buffers come and go (handed back by trim_heap) before
        # the weights arrive, instead of raising the peak on top of them
        files = read_model_files(store, state.name)
        tokenizer = ModelTokenizer(files.files, files.config, files.template, files.tokenizer)
        files.tokenizer = None
        trim_heap()
        loaded = load_model(store, state.name, state.compute_setting, progress, state.release,
                            files)
    except Exception as exc:  # any load failure ends the process with its reason
        state.error = f"error loading model {state.name}: {exc}"
        on_fail(state.error)
        return
    state.loaded, state.tokenizer = loaded, tokenizer
    if not is_vision_model(loaded.model):
        # the tokenizer holds it parsed; its text (1 MB for a 32k vocabulary) is read again
        # only to find an image placeholder token (runner/media/placeholders.py)
        loaded.files.files.pop("tokenizer.json", None)
    try:
        state.embedder = build_embedder(loaded.model, loaded.files.config, loaded.files.files,
                                        tokenizer)
    except (ValueError, KeyError) as exc:
        state.error = f"error loading model {state.name}: {exc}"
        on_fail(state.error)
        return
    if state.embedder is None:
        state.grammar = GrammarCompiler(tokenizer)
        state.generator = Generator(loaded.model, tokenizer, loaded.context_length,
                                    state.release, prefill_chunk(loaded.compute),
                                    draft=loaded.draft,
                                    prefix_cache=PrefixCache(state.prefix_cache_bytes))
    state.status, state.progress = "ready", 1.0
    print(f"loaded {state.name} in {loaded.load_seconds:.1f}s: compute {loaded.compute}, "
          f"weights {loaded.weights_bytes} bytes, blas {blas_library()}", file=sys.stderr,
          flush=True)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def prompt_text(tokenizer: ModelTokenizer, body: dict[str, Any]) -> str:
    """The rendered prompt a completion request asks for (messages, or prompt/system/raw)."""
    override = GoTemplate(body["template"]) if body.get("template") else None
    suffix = str(body.get("suffix") or "")
    if isinstance(body.get("messages"), list):
        return tokenizer.render(body["messages"], tools=body.get("tools") or None,
                                think=body.get("think"), suffix=suffix, template=override)
    if isinstance(body.get("prompt"), str):
        if body.get("raw"):
            return body["prompt"]
        messages = [{"role": "system", "content": body["system"]}] if body.get("system") else []
        messages.append({"role": "user", "content": body["prompt"]})
        return tokenizer.render(messages, think=body.get("think"), suffix=suffix,
                                template=override)
    raise PromptError("the request needs messages or a prompt")


def prompt_tokens(state: RunnerState, body: dict[str, Any]
                  ) -> tuple[str, list[int], ImageRequest | None]:
    """The prompt's text and ids; with images, ids whose image runs are keyed by content."""
    assert state.tokenizer is not None and state.loaded is not None
    tokenizer, model = state.tokenizer, state.loaded.model
    sentinel = new_sentinel()
    marked, images = mark_images(body, sentinel)
    if images and not is_vision_model(model):
        raise MediaError(f"model {state.name} does not support images: it is a text-only model")
    text = prompt_text(tokenizer, marked)
    if not images:
        return text, tokenizer.encode(text), None
    ids = encode_marked(text, sentinel, tokenizer.encode, lambda piece: tokenizer.tokenizer
                        .encode(piece, add_special_tokens=False).ids,
                        getattr(model, "IMAGE_TEXT_AROUND", ("", "")))
    request = assemble(model, state.loaded.files.files, ids, images)
    return text.replace(sentinel, ""), request.tokens, request


def build_app(store: Store, name: str, compute: str = "auto",
              release: Callable[[], None] = mx.clear_cache,
              on_fail: Callable[[str], None] | None = None,
              prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES) -> Starlette:
    state = RunnerState(name, compute, release, prefix_cache_bytes)

    def failed(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if on_fail is not None:
            on_fail(message)

    async def status(request: Request) -> Response:
        if state.error:
            return _error(500, state.error)
        loaded = state.loaded
        return JSONResponse({
            "status": state.status, "progress": state.progress, "model": name,
            "context_length": loaded.context_length if loaded else 0,
            "memory": {"rss": psutil.Process().memory_info().rss,
                       "weights": loaded.weights_bytes if loaded else 0},
            "compute": loaded.compute if loaded else compute, "blas": blas_library(),
            "draft": state.generator is not None and state.generator.drafting,
            "prefix_cache": _prefix_cache_status(state.generator)})

    async def tokenize(request: Request) -> Response:
        if state.tokenizer is None:
            return _error(503, f"model {name} is still loading")
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            return _error(400, "tokenize needs {\"content\": string}")
        return JSONResponse({"tokens": state.tokenizer.encode(body["content"])})

    async def completions(request: Request) -> Response:
        if state.embedder is not None:
            return _error(400, f"model {name} does not support generate")
        if state.generator is None or state.tokenizer is None or state.loaded is None:
            return _error(503, f"model {name} is still loading")
        body = await _json(request)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            options = Options.from_dict({**state.loaded.files.params,
                                         **(body.get("options") or {})})
            context = _context(body.get("context"))
            text, tokens, images = await asyncio.to_thread(prompt_tokens, state, body)
            if images is not None:
                images.spans = [(a + len(context), b + len(context)) for a, b in images.spans]
            tokens = context + tokens
            truncate = bool(body.get("truncate", True))
            fit_prompt(tokens, state.generator.num_ctx(options), truncate)
            run = Run(tokens, options, truncate, await _constraint(state, body.get("format")),
                      _logprobs(body), body.get("shift", True) is not False,
                      bool(body.get("return_context")),
                      text.rstrip().endswith(THINK_OPEN), images)
        except (OptionsError, PromptError, TemplateError, ContextError, TypeError,
                FormatError, MediaError) as exc:
            return _error(400, str(exc))
        job = _stream(state, run)
        return StreamingResponse(job, media_type="application/x-ndjson")

    async def embed(request: Request) -> Response:
        return await embed_route(state, request)

    routes = [Route("/v1/status", status, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/completion", completions, methods=["POST"]),
              Route("/v1/tokenize", tokenize, methods=["POST"]),
              Route("/v1/embed", embed, methods=["POST"])]
    app = Starlette(routes=routes)
    state.worker.submit(lambda: load_into(state, store, failed))
    app.state.runner = state
    return app


async def embed_route(state: RunnerState, request: Request) -> Response:
    """POST /v1/embed: one batched forward on the worker (docs/runner-protocol.md)."""
    if state.loaded is None:
        return _error(503, f"model {state.name} is still loading")
    embedder = state.embedder
    if embedder is None:
        return _error(400, f"model {state.name} does not support embeddings")
    body = await _json(request)
    texts = body.get("input") if isinstance(body, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        return _error(400, "embed needs {\"input\": [string, ...]}")
    options = body.get("options") if isinstance(body.get("options"), dict) else {}
    num_ctx = options.get("num_ctx")
    try:
        dimensions = embedding_dimensions(body.get("dimensions"))
        if num_ctx is not None and (not isinstance(num_ctx, int) or num_ctx <= 0):
            raise EmbedError("options.num_ctx must be a positive integer")
        async with state.lock:
            result = await _on_worker(state, lambda: embedder.embed(
                texts, body.get("truncate", True) is not False, dimensions, num_ctx))
    except EmbedError as exc:
        return _error(400, str(exc))
    return JSONResponse({"embeddings": result.vectors,
                         "prompt_eval_count": result.prompt_eval_count,
                         "prompt_eval_duration": result.prompt_eval_duration})


async def _on_worker(state: RunnerState, job: Callable[[], Any]) -> Any:
    """Run `job` on the MLX worker thread; its result or exception comes back here."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    loop = future.get_loop()

    def run() -> None:
        try:
            value = job()
        except BaseException as exc:  # handed to the awaiting request
            loop.call_soon_threadsafe(future.set_exception, exc)
            return
        loop.call_soon_threadsafe(future.set_result, value)

    state.worker.submit(run)
    return await future


def _prefix_cache_status(generator: Generator | None) -> dict[str, int]:
    cache = generator.prefix_cache if generator is not None else None
    if cache is None:
        return {"entries": 0, "bytes": 0, "budget": 0}
    return {"entries": len(cache), "bytes": cache.nbytes, "budget": cache.budget_bytes}


@dataclass(frozen=True)
class Run:
    """One completion as the worker runs it."""

    tokens: list[int]
    options: Options
    truncate: bool
    constraint: TokenConstraint | None
    logprobs: int | None  # alternatives per token; None: no logprobs
    shift: bool
    return_context: bool  # end with the token ids of prompt and answer (/api/generate)
    thinking_opened: bool = False  # the template opened a reasoning block for the model
    images: ImageRequest | None = None  # the images, their keys and spans


def _context(value: Any) -> list[int]:
    """/api/generate's `context`: the token ids a previous answer returned."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise PromptError("context must be a list of token ids")
    if any(t >= IMAGE_KEY_BASE for t in value):
        raise PromptError("context holds an earlier answer's image tokens, which are not kept "
                          "between requests: send the images again (or use /api/chat)")
    return value


def _logprobs(body: dict[str, Any]) -> int | None:
    """None when not asked for, else how many alternatives per token (0-20)."""
    top = body.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP:
        raise OptionsError(f"top_logprobs must be an integer from 0 to {MAX_TOP}")
    return top if body.get("logprobs") or top else None


async def _constraint(state: RunnerState, fmt: Any) -> TokenConstraint | None:
    """The grammar for a `format` ("json" or a schema); built off the event loop, since the
    first one converts the vocabulary."""
    if fmt is None or fmt == "" or state.grammar is None:
        return None
    return await asyncio.to_thread(state.grammar.constraint, fmt)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        return None


async def _stream(state: RunnerState, run: Run) -> AsyncIterator[bytes]:
    """Run one generation on the worker; relay its pieces as NDJSON lines."""
    assert state.generator is not None
    generator = state.generator
    async with state.lock:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, item)

        def job() -> None:
            try:
                if run.images is not None and run.images.digests:
                    key_images(run.images, run.tokens, state.image_slots,
                               generator.prefix_cache.clear)
                if is_vision_model(generator.model):
                    bind(generator.model, run.images or ImageRequest([], []))
                spans = run.images.spans if run.images is not None else ()
                for item in generator.generate(run.tokens, run.options, cancel.is_set,
                                               run.truncate, spans=spans,
                                               constraint=run.constraint,
                                               logprobs=run.logprobs, shift=run.shift):
                    if isinstance(item, Done) and run.return_context:
                        eos = generator.tokenizer.eos_ids
                        put((item, run.tokens + [t for t in generator.tokens if t not in eos]))
                    else:
                        put(item)
            except Exception as exc:  # reported to the client as the final line
                log.exception("generation failed")
                put(exc)
            finally:
                put(_END)

        state.worker.submit(job)
        if run.thinking_opened:  # so the model server reads the answer from inside the block
            yield (json.dumps({"content": "", "done": False, "thinking_opened": True})
                   + "\n").encode()
        try:
            while (item := await pieces.get()) is not _END:
                yield _line(item)
        finally:
            cancel.set()  # the client went away or we are done: stop generating now


def _line(item: Any) -> bytes:
    context = None
    if isinstance(item, tuple):
        item, context = item
    if isinstance(item, Exception):
        message: dict[str, Any] = {"error": f"generation failed: {item}"}
    elif isinstance(item, Done):
        message = {"content": "", "done": True, "done_reason": item.reason,
                   "prompt_eval_count": item.prompt_eval_count,
                   "prompt_eval_duration": item.prompt_eval_duration,
                   "eval_count": item.eval_count, "eval_duration": item.eval_duration,
                   "prompt_cached": item.prompt_cached}
        if item.draft is not None:
            message.update(draft_proposed=item.draft.proposed, draft_accepted=item.draft.accepted)
        if context is not None:
            message["context"] = context
    elif isinstance(item, Logprob):
        message = {"content": "", "logprobs": [item.to_json()], "done": False}
    else:
        message = {"content": item, "done": False}
    return (json.dumps(message) + "\n").encode()
