"""OpenAI-compatible routes: POST /v1/chat/completions (SSE or JSON) and GET /v1/models.

Requests are translated to the same runner request as /api/chat (OpenAI's sampling fields map
to Ollama option names), and errors use OpenAI's `{"error": {"message", "type", ...}}` shape,
since OpenAI client libraries read that and not Ollama's.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from registry.errors import FerryError
from server.api_errors import APIError, error_message, read_json, status_for
from server.chat_api import chat_messages, chat_runner_body
from server.chat_request import (
    THINK_LEVELS,
    load_model_defaults,
    logprob_fields,
    parse_name,
    refuse_unsupported,
    think_mode,
)
from server.completion import (
    Calls,
    ClientGone,
    CompletionJob,
    Item,
    Logprobs,
    Stats,
    Thinking,
    collect_while_connected,
    run_completion,
    start_stream,
)
from server.json_format import JSONFormat
from server.tool_calls import ToolCall, tool_names

FINISH = {"stop": "stop", "length": "length"}
Handler = Callable[[Request], Awaitable[Response]]


def _openai_error(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    kind = "invalid_request_error" if status < 500 else "api_error"
    body = {"error": {"message": error_message(exc), "type": kind, "param": None,
                      "code": "model_not_found" if status == 404 else None}}
    return JSONResponse(body, status_code=status)


def openai_errors(handler: Handler) -> Handler:
    """Render domain errors the OpenAI way for this route."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except FerryError as exc:
            return _openai_error(exc)
    return wrapped


def _text_content(content: Any) -> tuple[str, list[str]]:
    """OpenAI content (a string or a list of parts) as text, and its images' base64."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise APIError(400, "message content must be a string or a list of parts")
    text, images = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind == "image_url":
            images.append(_data_url(part.get("image_url")))
        else:
            raise APIError(400, f"unsupported content part type {kind!r}")
    return "".join(text), images


def _data_url(value: Any) -> str:
    """An image_url part's base64 payload; only data URLs (the server fetches nothing)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise APIError(400, "image_url must be a base64 data URL (data:image/...;base64,...)")
    return url.partition(";base64,")[2]


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty list")
    out = []
    for message in raw:
        if not isinstance(message, dict):
            raise APIError(400, "every message must be an object")
        text, images = _text_content(message.get("content"))
        converted: dict[str, Any] = {"role": message.get("role"), "content": text}
        if images:
            converted["images"] = images
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key):
                converted[key] = message[key]
        if message.get("reasoning"):
            converted["thinking"] = message["reasoning"]
        out.append(converted)
    return out


def _think(body: dict[str, Any]) -> bool | str | None:
    """`reasoning_effort` (or `reasoning.effort`) as Ollama's `think`; "none" turns it off."""
    reasoning = body.get("reasoning")
    effort = body.get("reasoning_effort")
    if effort is None and isinstance(reasoning, dict):
        effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort == "none":
        return False
    if effort not in THINK_LEVELS:
        raise APIError(400, f"invalid reasoning_effort {effort!r}: expected \"low\", "
                            '"medium", "high" or "none"')
    return str(effort)


def options_from(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sampling fields under Ollama's option names."""
    options: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
        if body.get(theirs) is not None:
            options[ours] = body[theirs]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        options["num_predict"] = limit
    stop = body.get("stop")
    if stop is not None:
        options["stop"] = [stop] if isinstance(stop, str) else stop
    return options


def _format(body: dict[str, Any]) -> JSONFormat | None:
    response_format = body.get("response_format") or {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return JSONFormat.parse("json")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return JSONFormat.parse(schema or "json")
    if kind not in (None, "text"):
        raise APIError(400, f"unsupported response_format type {kind!r}")
    return None


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"index": call.index, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call in calls]


def _finish(stats: Stats, calls: bool) -> str:
    return "tool_calls" if calls else FINISH.get(stats.done_reason, "stop")


def _usage(stats: Stats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_eval_count, "completion_tokens": stats.eval_count,
            "total_tokens": stats.prompt_eval_count + stats.eval_count,
            "prompt_tokens_details": {"cached_tokens": stats.prompt_cached}}


@openai_errors
async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    started = time.monotonic()
    body = await read_json(request)
    name = parse_name(body.get("model"))
    model = await asyncio.to_thread(load_model_defaults, request.app.state.store, name)
    messages, has_images = chat_messages(model, _messages(body.get("messages")))
    refuse_unsupported(model, {"tools": body.get("tools"),
                               "top_logprobs": body.get("top_logprobs")}, has_images)
    fmt = _format(body)
    think = _think(body)
    runner_body = chat_runner_body(model, messages, options_from(body), body.get("tools"), fmt,
                                   True, think)
    runner_body.update(logprob_fields(body))
    job = CompletionJob(request.app.state.scheduler, model, runner_body, None, fmt, started,
                        tool_names(body.get("tools")), think_mode(model, think))
    base = {"id": f"chatcmpl-{secrets.token_hex(8)}", "created": int(time.time()),
            "model": body["model"], "system_fingerprint": "fp_ferry"}
    if not body.get("stream"):
        try:
            answer = await collect_while_connected(run_completion(job),
                                                   request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; the runner has stopped
        message: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.thinking:
            message["reasoning"] = answer.thinking
        if answer.calls:
            message["tool_calls"] = _tool_calls(answer.calls)
        choice = {"index": 0, "message": message,
                  "finish_reason": _finish(answer.stats, bool(answer.calls)),
                  "logprobs": {"content": answer.logprobs} if answer.logprobs else None}
        return JSONResponse({**base, "object": "chat.completion", "choices": [choice],
                             "usage": _usage(answer.stats)})
    options = body.get("stream_options") or {}
    usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    first, rest = await start_stream(run_completion(job))
    return StreamingResponse(_sse(base, first, rest, usage), media_type="text/event-stream")


async def _sse(base: dict[str, Any], first: Item | None, rest: AsyncIterator[Item],
               include_usage: bool) -> AsyncIterator[bytes]:
    """Chunks as server-sent events: deltas, a finish chunk, usage if asked, then [DONE]."""
    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {**base, "object": "chat.completion.chunk", "choices": choices, **extra}
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

    called = False
    pending: list[dict[str, Any]] = []  # logprobs ride on the next delta out

    def choice(delta: dict[str, Any]) -> dict[str, Any]:
        nonlocal pending
        out = {"index": 0, "delta": delta, "finish_reason": None}
        if pending:
            out["logprobs"], pending = {"content": pending}, []
        return out

    try:
        item = first
        while item is not None:
            if isinstance(item, Logprobs):
                pending += item.entries
            elif isinstance(item, Stats):
                finish = _finish(item, called)
                yield event([{"index": 0, "delta": {}, "finish_reason": finish}])
                if include_usage:
                    yield event([], usage=_usage(item))
            elif isinstance(item, Calls):
                called = True
                delta = {"role": "assistant", "tool_calls": _tool_calls(item.calls)}
                yield event([choice(delta)])
            elif isinstance(item, Thinking):
                yield event([choice({"role": "assistant", "content": "",
                                     "reasoning": item.text})])
            else:
                yield event([choice({"role": "assistant", "content": item})])
            item = await anext(rest, None)
    except (FerryError, OSError) as exc:
        yield sse_error(exc)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: BaseException) -> bytes:
    """An error after the stream began: OpenAI's error object as the last event."""
    error = {"error": {"message": error_message(exc), "type": "api_error"}}
    return f"data: {json.dumps(error)}\n\n".encode()


@openai_errors
async def list_models(request: Request) -> Response:
    """GET /v1/models: every local model, OpenAI's list shape."""
    entries = await asyncio.to_thread(request.app.state.store.list_models)
    data = [{"id": e.name.display_shortest(), "object": "model", "created": int(e.modified_at),
             "owned_by": e.name.namespace} for e in entries]
    return JSONResponse({"object": "list", "data": data})


@openai_errors
async def get_model(request: Request) -> Response:
    """GET /v1/models/{model}."""
    name = parse_name(request.path_params["model"])
    entry = await asyncio.to_thread(request.app.state.store.get_model, name)
    return JSONResponse({"id": request.path_params["model"], "object": "model",
                         "created": int(entry.modified_at), "owned_by": name.namespace})


routes = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
