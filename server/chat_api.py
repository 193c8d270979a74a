"""Ollama's generate, chat and ps routes (reference 4.6) over the scheduler's runners.

A handler turns the request into a runner request (docs/runner-protocol.md) with the model's
defaults merged in, runs it through runner/completion.py, and renders Ollama's fields: text
pieces as `response` (generate) or `message` (chat), then a final object with `done_reason` and
the durations in nanoseconds. An empty prompt (or no messages) only loads the model, or unloads it
with `keep_alive: 0`, which is how `ferry stop` and `ollama stop` work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from registry.errors import FerryError
from registry.names import Name
from server.api_errors import APIError, error_message, read_json
from server.api_stream import NDJSON, ndjson_line
from server.chat_request import (
    ModelDefaults,
    expires_iso,
    fill_in_fields,
    load_model_defaults,
    logprob_fields,
    merge_options,
    now_iso,
    parse_keep_alive,
    parse_name,
    refuse_unsupported,
    think_mode,
)
from server.completion import (
    Answer,
    Calls,
    ClientGone,
    CompletionJob,
    Logprobs,
    Stats,
    Thinking,
    collect_while_connected,
    run_completion,
    start_stream,
)
from server.conversation import image_list, normalise_messages
from server.json_format import JSONFormat
from server.scheduler import Scheduler
from server.tool_calls import ToolCall, tool_names


def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def _model(request: Request, body: dict[str, Any]) -> ModelDefaults:
    name = parse_name(body.get("model") or body.get("name"))
    return await asyncio.to_thread(load_model_defaults, request.app.state.store, name)



def _piece(kind: str, model: str, text: str, calls: list[ToolCall] | None = None,
           thinking: str = "") -> dict[str, Any]:
    """A chat `message` (thinking and calls inside it) or a generate `response`/`thinking`."""
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if kind == "message":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [call.ollama() for call in calls]
        out["message"] = message
    else:
        out["response"] = text
        if thinking:
            out["thinking"] = thinking
    out["done"] = False
    return out


def _final(kind: str, model: str, stats: Stats, answer: Answer | None = None
           ) -> dict[str, Any]:
    answer = answer or Answer()
    out = _piece(kind, model, answer.text, answer.calls, answer.thinking)
    out["done"] = True
    out.update(stats.ollama_fields())
    if kind == "response" and stats.context is not None:
        out["context"] = stats.context  # deprecated in Ollama, still returned and accepted
    if answer.logprobs is not None:
        out["logprobs"] = answer.logprobs
    return out


def _event(kind: str, model: str, item: str | Thinking | Calls | Stats) -> dict[str, Any]:
    if isinstance(item, Stats):
        return _final(kind, model, item)
    if isinstance(item, Calls):
        return _piece(kind, model, "", item.calls)
    if isinstance(item, Thinking):
        return _piece(kind, model, "", thinking=item.text)
    return _piece(kind, model, item)


async def _respond(request: Request, kind: str, model: str, job: CompletionJob,
                   stream: bool) -> Response:
    """Run the job; NDJSON pieces when streaming, else one object with the whole text."""
    items = run_completion(job)
    if not stream:
        try:
            answer = await collect_while_connected(items, request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; the runner has stopped
        return JSONResponse(_final(kind, model, answer.stats, answer))
    first, rest = await start_stream(items)

    async def body() -> AsyncIterator[bytes]:
        pending: list[dict[str, Any]] = []  # logprobs ride on the next piece out
        try:
            item = first
            while item is not None:
                if isinstance(item, Logprobs):
                    pending += item.entries
                else:
                    event = _event(kind, model, item)
                    if pending:
                        event["logprobs"], pending = pending, []
                    yield ndjson_line(event)
                item = await anext(rest, None)
        except (FerryError, OSError) as exc:
            yield ndjson_line({"error": error_message(exc)})
        finally:
            await rest.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type=NDJSON)


async def _load_or_unload(request: Request, kind: str, model: ModelDefaults, shown: str,
                          keep_alive: float | None) -> Response:
    """No prompt: load the model (and hold it for keep_alive), or unload it for keep_alive 0."""
    stats = Stats(done_reason="load")
    scheduler = _scheduler(request)
    if keep_alive == 0:
        await scheduler.unload(model.name)
        stats.done_reason = "unload"
    else:
        lease = await scheduler.acquire(model, keep_alive)
        lease.release()
        stats.load_duration = int(lease.load_duration * 1e9)
    return JSONResponse(_final(kind, shown, stats))


async def generate(request: Request) -> Response:
    """POST /api/generate."""
    started = time.monotonic()
    body = await read_json(request)
    model = await _model(request, body)
    shown = str(body.get("model") or body.get("name"))
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string")
    refuse_unsupported(model, body, bool(body.get("images")))
    if not prompt:
        return await _load_or_unload(request, "response", model, shown, keep_alive)
    fmt = JSONFormat.parse(body.get("format"))
    think = think_mode(model, body.get("think"))
    runner_body = generate_runner_body(model, body, prompt, fmt)
    job = CompletionJob(_scheduler(request), model, runner_body, keep_alive, fmt, started,
                        think=think)
    return await _respond(request, "response", shown, job,
                          body.get("stream", True) is not False)


def generate_runner_body(model: ModelDefaults, body: dict[str, Any], prompt: str,
                         fmt: JSONFormat | None) -> dict[str, Any]:
    """The runner's body for a generate request (also used by /v1/completions)."""
    out = {**_generate_body(model, body, prompt, fmt), **logprob_fields(body),
           **fill_in_fields(model, body), "return_context": True}
    if body.get("context"):
        out["context"] = body["context"]
    return out


def _generate_body(model: ModelDefaults, body: dict[str, Any], prompt: str,
                   fmt: JSONFormat | None) -> dict[str, Any]:
    """Raw prompts go verbatim; others render as [system?, seed messages..., user]."""
    out: dict[str, Any] = {"options": merge_options(model, body.get("options")),
                           "truncate": body.get("truncate", True) is not False}
    if fmt is not None:
        out["format"] = fmt.runner_value()
    if body.get("think") is not None:
        out["think"] = body["think"]
    if body.get("shift") is False:
        out["shift"] = False
    if body.get("raw"):
        images = {"images": image_list(body["images"])} if body.get("images") else {}
        return {**out, "prompt": prompt, "raw": True, **images}
    system = body.get("system") or model.system
    messages = [{"role": "system", "content": system}] if system else []
    user: dict[str, Any] = {"role": "user", "content": prompt}
    if body.get("images"):
        user["images"] = image_list(body["images"])
    messages += [*model.messages, user]
    return {**out, "messages": messages}


def chat_messages(model: ModelDefaults, raw: Any) -> tuple[list[dict[str, Any]], bool]:
    """The conversation to render: seed messages and SYSTEM default first; has images?"""
    if raw is None:
        raw = []
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise APIError(400, "messages must be a list of objects")
    has_images = any(m.get("images") for m in raw)
    cleaned = normalise_messages(raw)
    if not cleaned:
        return [], has_images
    messages = [*model.messages, *cleaned]
    if cleaned[0]["role"] != "system" and model.system:
        messages.insert(0, {"role": "system", "content": model.system})
    return messages, has_images


async def chat(request: Request) -> Response:
    """POST /api/chat."""
    started = time.monotonic()
    body = await read_json(request)
    model = await _model(request, body)
    shown = str(body.get("model") or body.get("name"))
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    messages, has_images = chat_messages(model, body.get("messages"))
    refuse_unsupported(model, body, has_images)
    if not messages:
        return await _load_or_unload(request, "message", model, shown, keep_alive)
    fmt = JSONFormat.parse(body.get("format"))
    think = think_mode(model, body.get("think"))
    runner_body = chat_runner_body(model, messages, body.get("options"), body.get("tools"),
                                   fmt, body.get("truncate", True) is not False, body.get("think"))
    runner_body.update(logprob_fields(body))
    if body.get("shift") is False:
        runner_body["shift"] = False
    job = CompletionJob(_scheduler(request), model, runner_body, keep_alive, fmt, started,
                        tool_names(body.get("tools")), think)
    return await _respond(request, "message", shown, job,
                          body.get("stream", True) is not False)


def chat_runner_body(model: ModelDefaults, messages: list[dict[str, Any]], options: Any,
                     tools: Any, fmt: JSONFormat | None, truncate: bool,
                     think: Any = None) -> dict[str, Any]:
    """The runner's /v1/completions body for a conversation (also used by the OpenAI route)."""
    out: dict[str, Any] = {"messages": messages, "options": merge_options(model, options),
                           "truncate": truncate}
    if fmt is not None:
        out["format"] = fmt.runner_value()
    if think is not None:
        out["think"] = think
    if tools:
        if not isinstance(tools, list):
            raise APIError(400, "tools must be a list")
        out["tools"] = tools
    return out


async def ps(request: Request) -> JSONResponse:
    """GET /api/ps: the loaded models, most recently used first, with the runner's compute."""
    models = []
    for runner in _scheduler(request).running():
        name = Name.parse(runner.name)
        try:
            details = (await asyncio.to_thread(
                load_model_defaults, request.app.state.store, name)).details()
        except (FerryError, OSError, ValueError):
            details = {}
        models.append({
            "name": name.display_shortest(), "model": name.display_shortest(),
            "size": runner.size, "digest": runner.digest, "details": details,
            "expires_at": expires_iso(runner.until()), "size_vram": 0,
            "context_length": runner.status.get("context_length", 0),
            "compute": runner.status.get("compute", ""),
        })
    return JSONResponse({"models": models})


routes = [
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/ps", ps, methods=["GET"]),
]
