"""The /api routes over the local store (Ollama's API, reference 4.3-4.5).

Handlers parse and validate the request, call the store off the event loop, and raise domain
errors; `api_errors` renders every failure as `{"error": "..."}` with its status, so the
official Ollama clients see the bodies and codes they expect.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from registry.digests import Digest
from registry.errors import InvalidName, NotFound
from registry.model_show import IncompleteModel, list_tags, show_model
from registry.names import Name
from registry.store import Store
from server.api_errors import APIError, read_json, require_str

log = logging.getLogger("ferry.api")


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def root(request: Request) -> Response:
    """Clients probe `/` to see whether the server is up (Ollama answers "Ollama is running")."""
    return PlainTextResponse("ferry is running")


async def version(request: Request) -> JSONResponse:
    """The version the app was built with (`app.state.version`, set by whoever builds the app)."""
    return JSONResponse({"version": getattr(request.app.state, "version", "0.0.0")})


async def tags(request: Request) -> JSONResponse:
    models = await asyncio.to_thread(list_tags, _store(request))
    return JSONResponse({"models": models})


def _check_pinned_digest(store: Store, name: Name, text: str) -> None:
    """`model@sha256:...` names one manifest: refuse when the tag now points elsewhere."""
    if not name.digest:
        return
    try:
        actual = store.get_model(name).digest
    except NotFound as exc:
        raise NotFound(f"model '{text}' not found") from exc
    if actual != Digest.parse(name.digest):
        raise NotFound(f"model '{text}' not found: {name.display_shortest()} is {actual} now")


async def show(request: Request) -> JSONResponse:
    data = await read_json(request)
    text = require_str(data, "model", "name")
    name = Name.parse_valid(text)
    verbose = data.get("verbose") is True
    store = _store(request)
    await asyncio.to_thread(_check_pinned_digest, store, name, text)
    try:
        body = await asyncio.to_thread(show_model, store, name, verbose)
    except IncompleteModel:
        raise
    except NotFound as exc:
        raise NotFound(f"model '{text}' not found") from exc
    return JSONResponse(body)


def _path_digest(request: Request) -> Digest:
    """From the raw path: the route's parameter has a trailing newline already dropped."""
    return Digest.parse(request.scope["path"].removeprefix("/api/blobs/"))


async def head_blob(request: Request) -> Response:
    digest = _path_digest(request)
    if not await asyncio.to_thread(_store(request).has_blob, digest):
        raise NotFound(f'blob "{digest}" not found')
    return Response(status_code=200)


async def create_blob(request: Request) -> Response:
    """Stream the body into the store; 200 without reading it when the blob is already here."""
    digest = _path_digest(request)
    store = _store(request)
    if await asyncio.to_thread(store.has_blob, digest):
        return Response(status_code=200)
    try:
        writer = await asyncio.to_thread(store.blob_writer, digest)
        await writer.write_stream(request.stream())
    except ClientDisconnect:
        # The writer already removed its temp file; nobody is left to read a response.
        log.info("upload of %s stopped: the client disconnected mid-body", digest)
        return Response(status_code=400)
    return Response(status_code=201)


async def copy(request: Request) -> Response:
    data = await read_json(request)
    source_text = _optional_str(data, "source")
    destination_text = _optional_str(data, "destination")
    source = _valid_name(source_text, "source")
    destination = _valid_name(destination_text, "destination")
    if destination.digest:
        raise APIError(400, f'destination "{destination_text}" is invalid: a copy needs a tag, '
                       "not a digest")
    store = _store(request)
    await asyncio.to_thread(_check_pinned_digest, store, source, source_text)
    try:
        await asyncio.to_thread(store.copy_model, source, destination)
    except NotFound as exc:
        raise NotFound(f'model "{source_text}" not found') from exc
    return Response(status_code=200)


async def delete(request: Request) -> Response:
    data = await read_json(request)
    text = require_str(data, "model", "name")
    try:
        name = Name.parse_valid(text)
    except InvalidName as exc:
        raise APIError(400, f'name "{text}" is invalid: {exc.reason}') from exc
    store = _store(request)
    await asyncio.to_thread(_check_pinned_digest, store, name, text)
    try:
        await asyncio.to_thread(store.delete_model, name)
    except NotFound as exc:
        raise NotFound(f"model '{text}' not found") from exc
    return Response(status_code=200)


def _optional_str(data: dict, key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise APIError(400, f"{key} must be a string")
    return value


def _valid_name(text: str, role: str) -> Name:
    """Parse a copy endpoint's name; Ollama's message is `source "x" is invalid`."""
    try:
        return Name.parse_valid(text)
    except InvalidName as exc:
        raise APIError(400, f'{role} "{text}" is invalid: {exc.reason}') from exc


routes = [
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/api/version", version, methods=["GET"]),
    Route("/api/tags", tags, methods=["GET", "HEAD"]),
    Route("/api/show", show, methods=["POST"]),
    # `:path` so a digest with an encoded slash still reaches the handler and gets its 400.
    Route("/api/blobs/{digest:path}", head_blob, methods=["HEAD"]),
    Route("/api/blobs/{digest:path}", create_blob, methods=["POST"]),
    Route("/api/copy", copy, methods=["POST"]),
    Route("/api/delete", delete, methods=["DELETE"]),
]
