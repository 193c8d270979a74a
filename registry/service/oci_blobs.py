"""The /v2 blob and upload routes: GET/HEAD/DELETE blobs, and upload sessions."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from registry.decimal_text import saturating_decimal
from registry.digests import Digest
from registry.names import parse_repository
from registry.service import paths
from registry.service.auth.gate import mount_source
from registry.service.errors import RegistryError
from registry.service.registry import Registry
from registry.service.storage.base import Stat
from registry.service.uploads import Chunk, range_header

INLINE_BODY = 256 * 1024  # blobs up to this size are answered in one body, bigger ones streamed
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")  # ASCII digits: \d takes any script's


def _registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


def parse_digest(text: str) -> Digest:
    return Digest.parse_wire(text)  # InvalidDigest -> 400 DIGEST_INVALID


def _session_headers(repo: str, upload_id: str, offset: int) -> dict[str, str]:
    return {
        "Location": f"/v2/{repo}/blobs/uploads/{upload_id}",
        "Docker-Upload-UUID": upload_id,
        "Range": range_header(offset),
        "Content-Length": "0",
    }


def _created(repo: str, digest: Digest) -> Response:
    return Response(status_code=201, headers={
        "Location": f"/v2/{repo}/blobs/{digest}",
        "Docker-Content-Digest": str(digest),
        "Content-Length": "0",
    })


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return "chunked" in request.headers.get("transfer-encoding", "").lower()


# -- blobs ----------------------------------------------------------------------------------------


async def blob_get(request: Request, repo: str, reference: str) -> Response:
    reg = _registry(request)
    digest = parse_digest(reference)
    stat = await reg.blobs.stat(repo, digest)
    if stat is None:
        raise RegistryError("BLOB_UNKNOWN", detail={"digest": str(digest)})
    return await blob_response(request, reg, digest, stat)


async def blob_response(request: Request, reg: Registry, digest: Digest, stat: Stat) -> Response:
    """The GET or HEAD response for a blob the caller found (`stat`) and may serve; the
    pull-through cache calls it with its own lookup, so a hit is looked up once."""
    key = paths.blob(digest)
    redirect = reg.store.redirect_url(key)
    if redirect is not None and request.method == "GET":
        return Response(status_code=307, headers={"Location": redirect,
                                                  "Docker-Content-Digest": str(digest)})
    headers = {
        "Docker-Content-Digest": str(digest),
        "ETag": f'"{digest}"',
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    start, end, status = 0, stat.size - 1, 200
    wanted = request.headers.get("range")
    if wanted:
        start, end = _satisfiable_range(wanted, stat.size)
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end}/{stat.size}"
    length = max(end - start + 1, 0)
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    if length <= INLINE_BODY:
        body = b"".join([piece async for piece in reg.store.read(key, start, length)])
        return Response(body, status_code=status, headers=headers)
    return StreamingResponse(reg.store.read(key, start, length), status_code=status,
                             headers=headers)


def _satisfiable_range(header: str, size: int) -> tuple[int, int]:
    """One `bytes=a-b` / `a-` / `-n` range clamped to the blob; 416 when it cannot be served."""
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        raise _unsatisfiable(size)
    first, last = match.group(1), match.group(2)
    if first == "":
        suffix = saturating_decimal(last) or 0
        if suffix == 0:
            raise _unsatisfiable(size)
        return max(size - suffix, 0), size - 1
    start = saturating_decimal(first) or 0
    end = min(saturating_decimal(last) or 0, size - 1) if last else size - 1
    if start >= size or start > end:
        raise _unsatisfiable(size)
    return start, end


def _unsatisfiable(size: int) -> RegistryError:
    return RegistryError("RANGE_NOT_SATISFIABLE", headers={"Content-Range": f"bytes */{size}"})


async def blob_delete(request: Request, repo: str, reference: str) -> Response:
    digest = parse_digest(reference)
    if not await _registry(request).blobs.unlink(repo, digest):
        raise RegistryError("BLOB_UNKNOWN", detail={"digest": str(digest)})
    return Response(status_code=202, headers={"Docker-Content-Digest": str(digest),
                                               "Content-Length": "0"})


# -- uploads --------------------------------------------------------------------------------------


async def upload_start(request: Request, repo: str, _: str) -> Response:
    """POST: a new session (202), a mount (201), or a whole monolithic upload (201)."""
    reg = _registry(request)
    query = request.query_params
    if "mount" in query:
        digest = parse_digest(query["mount"])
        source = parse_repository(query["from"]) if query.get("from") else None
        if await reg.blobs.mount(repo, digest, mount_source(request, repo, source)):
            return _created(repo, digest)
    elif "digest" in query:
        digest = parse_digest(query["digest"])
        if not _has_body(request) and await reg.blobs.mount(repo, digest,
                                                            mount_source(request, repo, None)):
            return _created(repo, digest)  # already here: nothing to send (x/transfer's probe)
        if _has_body(request) or digest == Digest.of(b""):
            await reg.uploads.monolithic(repo, digest, request.stream())
            return _created(repo, digest)
    upload_id = await reg.uploads.start(repo)
    return Response(status_code=202, headers=_session_headers(repo, upload_id, 0))


async def upload_status(request: Request, repo: str, upload_id: str) -> Response:
    offset = await _registry(request).uploads.offset(repo, upload_id)
    return Response(status_code=204, headers=_session_headers(repo, upload_id, offset))


async def upload_patch(request: Request, repo: str, upload_id: str) -> Response:
    chunk = None
    if "content-range" in request.headers:
        chunk = Chunk.parse(request.headers["content-range"])
        length = request.headers.get("content-length")
        if length is not None and saturating_decimal(length) != chunk.length:
            raise RegistryError("BLOB_UPLOAD_INVALID",
                                f"Content-Length {length} does not match Content-Range")
    uploads = _registry(request).uploads
    offset = await uploads.append(repo, upload_id, request.stream(), chunk)
    return Response(status_code=202, headers=_session_headers(repo, upload_id, offset))


async def upload_finish(request: Request, repo: str, upload_id: str) -> Response:
    if "digest" not in request.query_params:
        raise RegistryError("DIGEST_INVALID", "the digest query parameter is required")
    digest = parse_digest(request.query_params["digest"])
    body: AsyncIterator[bytes] | None = request.stream() if _has_body(request) else None
    await _registry(request).uploads.finish(repo, upload_id, digest, body)
    return _created(repo, digest)


async def upload_cancel(request: Request, repo: str, upload_id: str) -> Response:
    await _registry(request).uploads.cancel(repo, upload_id)
    return Response(status_code=204, headers={"Content-Length": "0"})
