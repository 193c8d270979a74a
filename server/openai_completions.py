"""POST /v1/completions: OpenAI's legacy text completions, mapped as Ollama maps them.

A request becomes an /api/generate request (the prompt goes through the model's template,
`suffix` fills `.Suffix` for code models), so editor plugins that speak this API get
fill-in-the-middle. A list of prompts is answered one after another, one choice each (streaming
takes one prompt). `logprobs: n` returns OpenAI's legacy shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`); `echo` puts the prompt before the text.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from registry.errors import FerryError
from server.api_errors import APIError, read_json
from server.chat_api import generate_runner_body
from server.chat_request import ModelDefaults, load_model_defaults, parse_name, refuse_unsupported
from server.completion import (
    Answer,
    ClientGone,
    CompletionJob,
    Logprobs,
    Stats,
    collect_while_connected,
    run_completion,
    start_stream,
)
from server.openai_api import FINISH, SSE_DONE, openai_errors, options_from, sse_error

# Each prompt is a whole generation, run one after another: a list is capped so one request
# cannot queue an unbounded amount of work.
MAX_PROMPTS = 16


def _prompts(value: Any) -> list[str]:
    prompts = [value] if isinstance(value, str) else value
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) for p in prompts):
        raise APIError(400, "prompt must be a string or a non-empty list of strings")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(400, f"send at most {MAX_PROMPTS} prompts per request (got "
                            f"{len(prompts)}); split larger batches")
    return prompts


def _generate_request(body: dict[str, Any], prompt: str) -> dict[str, Any]:
    """The /api/generate request that answers one prompt."""
    out: dict[str, Any] = {"model": body.get("model"), "prompt": prompt,
                           "options": options_from(body)}
    if body.get("suffix"):
        out["suffix"] = body["suffix"]
    top = body.get("logprobs")
    if top is not None and top is not False:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise APIError(400, "logprobs must be an integer from 0 to 20")
        out.update(logprobs=True, top_logprobs=top)
    return out


def _legacy_logprobs(entries: list[dict[str, Any]] | None, offset: int) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        at += len(entry["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
                             for e in entries],
            "text_offset": offsets}


def _usage(stats: list[Stats]) -> dict[str, int]:
    prompt = sum(s.prompt_eval_count for s in stats)
    completion = sum(s.eval_count for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@openai_errors
async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    body = await read_json(request)
    name = parse_name(body.get("model"))
    model = await asyncio.to_thread(load_model_defaults, request.app.state.store, name)
    prompts = _prompts(body.get("prompt"))
    refuse_unsupported(model, {}, False)
    base = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion",
            "created": int(time.time()), "model": body["model"],
            "system_fingerprint": "fp_ferry"}
    echo = body.get("echo") is True
    if body.get("stream"):
        if len(prompts) != 1:
            raise APIError(400, "streaming takes a single prompt")
        job = _job(request, model, _generate_request(body, prompts[0]))
        first, rest = await start_stream(run_completion(job))
        return StreamingResponse(_sse(base, first, rest, prompts[0] if echo else ""),
                                 media_type="text/event-stream")
    choices, stats = [], []
    for index, prompt in enumerate(prompts):
        job = _job(request, model, _generate_request(body, prompt))
        try:
            answer = await collect_while_connected(run_completion(job), request.is_disconnected)
        except ClientGone:
            return Response(status_code=499)
        choices.append(_choice(index, answer, prompt if echo else ""))
        stats.append(answer.stats)
    return JSONResponse({**base, "choices": choices, "usage": _usage(stats)})


def _job(request: Request, model: ModelDefaults, generate: dict[str, Any]) -> CompletionJob:
    runner_body = generate_runner_body(model, generate, generate["prompt"], None)
    return CompletionJob(request.app.state.scheduler, model, runner_body, None, None,
                         time.monotonic())


def _choice(index: int, answer: Answer, echoed: str) -> dict[str, Any]:
    return {"index": index, "text": echoed + answer.text,
            "logprobs": _legacy_logprobs(answer.logprobs, len(echoed)),
            "finish_reason": FINISH.get(answer.stats.done_reason, "stop")}


async def _sse(base: dict[str, Any], first: Any, rest: AsyncIterator[Any],
               echoed: str) -> AsyncIterator[bytes]:
    def event(text: str, finish: str | None, logprobs: Any = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n".encode()

    pending: list[dict[str, Any]] = []
    offset = 0
    try:
        if echoed:
            yield event(echoed, None)
            offset = len(echoed)
        item = first
        while item is not None:
            if isinstance(item, Logprobs):
                pending += item.entries
            elif isinstance(item, Stats):
                yield event("", FINISH.get(item.done_reason, "stop"))
            elif isinstance(item, str):
                yield event(item, None, _legacy_logprobs(pending, offset) if pending else None)
                offset, pending = offset + len(item), []
            item = await anext(rest, None)
    except (FerryError, OSError) as exc:
        yield sse_error(exc)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


routes = [Route("/v1/completions", completions, methods=["POST"])]
