"""OCI distribution error codes, their HTTP statuses, and the one handler that renders them.

Route handlers and the layers below raise `RegistryError(code, ...)` or the shared domain errors
of `registry.errors`; nothing else builds an error response. The body is the spec's
`{"errors": [{"code", "message", "detail"}]}`.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from registry.errors import (
    Conflict,
    DigestMismatch,
    FerryError,
    InvalidDigest,
    InvalidManifest,
    InvalidName,
    NotFound,
    SizeMismatch,
    TooLarge,
)

log = logging.getLogger("ferry.registry")
# The request state's key for the status of the error response `handle_error` made: the access
# middleware audits a read only when it was refused, and learns so here instead of wrapping the
# `send` of every read to watch its status.
ERROR_STATUS = "error_status"

# name -> (wire code, HTTP status, default message): the one table. A few names share a wire
# code but not a status: an oversized manifest is MANIFEST_INVALID with 413, a chunk that does not
# start at the session's offset is BLOB_UPLOAD_INVALID with 416 (as distribution answers).
ERROR_CODES: dict[str, tuple[str, int, str]] = {
    "BLOB_UNKNOWN": ("BLOB_UNKNOWN", 404, "blob unknown to registry"),
    "BLOB_UPLOAD_INVALID": ("BLOB_UPLOAD_INVALID", 400, "blob upload invalid"),
    "BLOB_UPLOAD_UNKNOWN": ("BLOB_UPLOAD_UNKNOWN", 404, "blob upload unknown to registry"),
    "DIGEST_INVALID": ("DIGEST_INVALID", 400, "provided digest did not match uploaded content"),
    "MANIFEST_BLOB_UNKNOWN": ("MANIFEST_BLOB_UNKNOWN", 400,
                              "manifest references a manifest or blob unknown to registry"),
    "MANIFEST_INVALID": ("MANIFEST_INVALID", 400, "manifest invalid"),
    "MANIFEST_TOO_LARGE": ("MANIFEST_INVALID", 413, "manifest too large"),
    "MANIFEST_UNKNOWN": ("MANIFEST_UNKNOWN", 404, "manifest unknown to registry"),
    "NAME_INVALID": ("NAME_INVALID", 400, "invalid repository name"),
    "NAME_UNKNOWN": ("NAME_UNKNOWN", 404, "repository name not known to registry"),
    "SIZE_INVALID": ("SIZE_INVALID", 400, "provided length did not match content length"),
    "BODY_TOO_LARGE": ("SIZE_INVALID", 413, "request body too large"),
    "BLOB_TOO_LARGE": ("SIZE_INVALID", 413, "blob too large"),
    "UPLOAD_RANGE_INVALID": ("BLOB_UPLOAD_INVALID", 416, "chunk does not start at the offset"),
    "RANGE_NOT_SATISFIABLE": ("BLOB_UNKNOWN", 416, "requested range not satisfiable"),
    "PAGINATION_NUMBER_INVALID": ("PAGINATION_NUMBER_INVALID", 400,
                                  "invalid number of results requested"),
    "UNSUPPORTED": ("UNSUPPORTED", 405, "the operation is unsupported"),
    "DENIED": ("DENIED", 403, "requested access to the resource is denied"),
    "TOOMANYREQUESTS": ("TOOMANYREQUESTS", 429, "too many requests"),
    "UNKNOWN": ("UNKNOWN", 500, "unknown error"),
    "UNAUTHORIZED": ("UNAUTHORIZED", 401, "authentication required"),
    "SCOPE_INVALID": ("UNSUPPORTED", 400, "invalid token scope"),
    "UPSTREAM_FAILED": ("UNAVAILABLE", 502, "the upstream registry failed"),
}


class RegistryError(Exception):
    """An OCI error: `code` names a row of ERROR_CODES; `headers` go on the response (Range)."""

    def __init__(
        self,
        code: str,
        message: str | None = None,
        detail: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown OCI error code {code!r}")
        self.code = code
        self.message = message or ERROR_CODES[code][2]
        self.detail = detail
        self.headers = headers or {}
        super().__init__(f"{code}: {self.message}")

    @property
    def status(self) -> int:
        return ERROR_CODES[self.code][1]

    @property
    def wire_code(self) -> str:
        return ERROR_CODES[self.code][0]


def from_domain(exc: BaseException) -> RegistryError:
    """Map a shared domain error (or anything unexpected) to its OCI error."""
    if isinstance(exc, RegistryError):
        return exc
    message = exc.message if isinstance(exc, FerryError) else "internal error"
    match exc:
        case ClientDisconnect():
            return RegistryError("BLOB_UPLOAD_INVALID", "the client disconnected mid-request")
        case InvalidDigest() | DigestMismatch():
            return RegistryError("DIGEST_INVALID", message)
        case InvalidName():
            return RegistryError("NAME_INVALID", message)
        case TooLarge() if exc.what == "manifest":
            return RegistryError("MANIFEST_TOO_LARGE", message, {"limit": exc.limit})
        case TooLarge():
            return RegistryError("BODY_TOO_LARGE", message, {"limit": exc.limit})
        case SizeMismatch():
            return RegistryError("SIZE_INVALID", message)
        case InvalidManifest():
            return RegistryError("MANIFEST_INVALID", message)
        case NotFound():
            return RegistryError("NAME_UNKNOWN", message)
        case Conflict():
            return RegistryError("DENIED", message)
    return RegistryError("UNKNOWN", message)


def error_response(exc: BaseException) -> Response:
    err = from_domain(exc)
    if err.status >= 500:
        log.error("internal error", exc_info=exc)
    entry: dict[str, Any] = {"code": err.wire_code, "message": err.message}
    if err.detail is not None:
        entry["detail"] = err.detail
    return JSONResponse({"errors": [entry]}, status_code=err.status, headers=err.headers)


async def handle_error(request: Request, exc: Exception) -> Response:
    response = error_response(exc)
    request.scope.setdefault("state", {})[ERROR_STATUS] = response.status_code
    return response
