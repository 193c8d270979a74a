"""Embedding routes: Ollama's /api/embed and legacy /api/embeddings, OpenAI's /v1/embeddings.

All three send the whole batch to the runner's POST /v1/embed in one request (one padded
forward, docs/runner-protocol.md) and return its L2-normalised vectors. Only a model whose
config carries the `embedding` capability is asked; any other gets Ollama's 400 "does not
support embeddings" before anything is loaded.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.api_errors import APIError, read_json
from server.chat_request import (
    ModelDefaults,
    load_model_defaults,
    merge_options,
    parse_keep_alive,
    parse_name,
)
from server.openai_api import openai_errors


async def _embedding_model(request: Request, body: dict[str, Any]) -> ModelDefaults:
    name = parse_name(body.get("model") or body.get("name"))
    model = await asyncio.to_thread(load_model_defaults, request.app.state.store, name)
    if "embedding" not in model.capabilities:
        raise APIError(400, f'"{name.display_shortest()}" does not support embeddings')
    return model


def _dimensions(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise APIError(400, "dimensions must be a positive integer")
    return value


# One request's inputs are embedded together and answered in one body; the runner groups them
# by a padded-token budget, so this only bounds the work and the reply one request can ask for.
MAX_INPUTS = 2048


def _texts(value: Any, allow_empty: bool = True) -> list[str]:
    """`input`: a string or a list of strings; an empty string is no input, as in Ollama."""
    if isinstance(value, str):
        texts = [value] if value else []
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        texts = list(value)
    elif value is None:
        texts = []
    else:
        raise APIError(400, "input must be a string or a list of strings")
    if not texts and not allow_empty:
        raise APIError(400, "input must not be empty")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs per request (got {len(texts)}); "
                            "split larger batches")
    return texts


async def run_embed(request: Request, model: ModelDefaults, body: dict[str, Any],
                    texts: list[str], dimensions: int | None) -> dict[str, Any]:
    """Acquire the model's runner (loading it if needed) and embed `texts` in one request;
    the runner's answer plus `load_duration` (ns). No texts: the model is only loaded."""
    options = merge_options(model, body.get("options"))
    keep_alive = parse_keep_alive(body.get("keep_alive"))
    lease = await request.app.state.scheduler.acquire(model, keep_alive)
    try:
        result: dict[str, Any] = {"embeddings": [], "prompt_eval_count": 0}
        if texts:
            result = await lease.embed({"input": texts, "dimensions": dimensions,
                                        "truncate": body.get("truncate", True) is not False,
                                        "options": options})
    finally:
        lease.release()
    result["load_duration"] = int(lease.load_duration * 1e9)
    return result


async def embed(request: Request) -> Response:
    """POST /api/embed."""
    started = time.monotonic()
    body = await read_json(request)
    texts = _texts(body.get("input"))
    dimensions = _dimensions(body.get("dimensions"))
    model = await _embedding_model(request, body)
    result = await run_embed(request, model, body, texts, dimensions)
    return JSONResponse({
        "model": str(body.get("model") or body.get("name")),
        "embeddings": result["embeddings"],
        "total_duration": int((time.monotonic() - started) * 1e9),
        "load_duration": result["load_duration"],
        "prompt_eval_count": int(result.get("prompt_eval_count") or 0)})


async def embeddings(request: Request) -> Response:
    """POST /api/embeddings (legacy): one `prompt`, one `embedding`."""
    body = await read_json(request)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string")
    model = await _embedding_model(request, body)
    result = await run_embed(request, model, body, [prompt] if prompt else [], None)
    vectors = result["embeddings"]
    return JSONResponse({"embedding": vectors[0] if vectors else []})


def _openai_vector(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


async def openai_embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""
    body = await read_json(request)
    texts = _texts(body.get("input"), allow_empty=False)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise APIError(400, 'encoding_format must be "float" or "base64"')
    dimensions = _dimensions(body.get("dimensions"))
    model = await _embedding_model(request, body)
    result = await run_embed(request, model, {"keep_alive": body.get("keep_alive")}, texts,
                             dimensions)
    data = [{"object": "embedding", "embedding": _openai_vector(v, encoding), "index": i}
            for i, v in enumerate(result["embeddings"])]
    tokens = int(result.get("prompt_eval_count") or 0)
    return JSONResponse({"object": "list", "data": data, "model": str(body.get("model")),
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


routes = [
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
    Route("/v1/embeddings", openai_errors(openai_embeddings), methods=["POST"]),
]
