"""Upload sessions (a ferry extension beside Ollama's `/api/blobs`): send a file while hashing it.

    POST  /api/uploads              {"size": N}  -> 201 {"id": "<hex>", "size": N}
    PATCH /api/uploads/<id>         the N bytes  -> 204 once all arrived (200s only then)
    PUT   /api/uploads/<id>?digest=sha256:...    -> 201 {"digest": ...} when the bytes match
    DELETE /api/uploads/<id>                     -> 204: abandoned (a create reading it fails)

The shape is the OCI distribution API's chunked upload (start, send, finish with the digest).
`ferry create` uses it so the server can quantize a file while it arrives: it names the file
`upload:<id>` in `/api/create`'s `files` map and sends the digest it computed while streaming
once the body is through. Ollama's own flow (HEAD/POST /api/blobs/<digest>) is unchanged.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from registry.digests import Digest
from registry.errors import NotFound
from registry.upload_sessions import Upload, Uploads
from server.api_errors import APIError, read_json

log = logging.getLogger("ferry.api")


def _uploads(request: Request) -> Uploads:
    uploads: Uploads = request.app.state.uploads
    return uploads


def _session(request: Request) -> Upload:
    upload_id = request.path_params["upload_id"]
    upload = _uploads(request).get(upload_id)
    if upload is None:
        raise NotFound(f'upload "{upload_id}" not found')
    return upload


async def start_upload(request: Request) -> Response:
    data = await read_json(request)
    size = data.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise APIError(400, "size must be a non-negative integer (the file's length in bytes)")
    upload = await asyncio.to_thread(_uploads(request).start, size)
    return JSONResponse({"id": upload.id, "size": size}, status_code=201)


async def send_bytes(request: Request) -> Response:
    upload = _session(request)
    try:
        await upload.receive(request.stream())
    except ClientDisconnect:
        log.info("upload %s stopped: the client disconnected mid-body", upload.id)
        return Response(status_code=400)
    return Response(status_code=204)


async def finish_upload(request: Request) -> Response:
    upload = _session(request)
    text = request.query_params.get("digest")
    if not text:
        raise APIError(400, "the digest query parameter is required")
    digest = Digest.parse(text)
    actual = await asyncio.to_thread(upload.commit, digest)  # a mismatch is a 400
    return JSONResponse({"digest": str(actual)}, status_code=201)


async def cancel_upload(request: Request) -> Response:
    upload = _session(request)
    await asyncio.to_thread(upload.fail, "cancelled by the client")
    return Response(status_code=204)


routes = [
    Route("/api/uploads", start_upload, methods=["POST"]),
    Route("/api/uploads/{upload_id}", send_bytes, methods=["PATCH"]),
    Route("/api/uploads/{upload_id}", finish_upload, methods=["PUT"]),
    Route("/api/uploads/{upload_id}", cancel_upload, methods=["DELETE"]),
]
