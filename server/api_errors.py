"""The model API's error edge: domain exceptions to Ollama's `{"error": "..."}` bodies.

The twin of `service/errors.py` (which speaks the OCI error JSON). Route handlers raise domain
errors or `APIError`; the one exception handler here renders them, so no handler builds an error
response by hand.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from registry import bounded_json
from registry.decimal_text import saturating_decimal
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
from server.runner_process import RunnerError
from server.scheduler import InsufficientMemory, SchedulerClosed

log = logging.getLogger("ferry.api")



def _runner_status(exc: RunnerError) -> int:
    """A request the runner refused (4xx) keeps its status; any other runner failure is a 500."""
    status = exc.runner_status
    return status if status is not None and 400 <= status < 500 else 500


# The one table from domain errors to statuses; the first matching entry wins, any other
# FerryError is a 400 and anything else a 500.
_STATUS: list[tuple[type[FerryError], int | Callable[[Any], int]]] = [
    (NotFound, 404),
    (TooLarge, 413),
    (Conflict, 409),
    (InvalidName, 400),
    (InvalidDigest, 400),
    (DigestMismatch, 400),
    (SizeMismatch, 400),
    (InvalidManifest, 400),
    (InsufficientMemory, 500),
    (SchedulerClosed, 503),
    (RunnerError, _runner_status),
]


class APIError(FerryError):
    """An error with an explicit HTTP status, for conditions no domain error names."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_for(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status if isinstance(status, int) else status(exc)
    return 400 if isinstance(exc, FerryError) else 500


def error_message(exc: BaseException) -> str:
    if isinstance(exc, FerryError):
        return exc.message
    if isinstance(exc, OSError):  # its str() names a server path; its strerror does not
        return exc.strerror or type(exc).__name__
    if status_for(exc) >= 500:  # an unexpected error's text may name server paths or internals
        return f"internal error ({type(exc).__name__}); the server log has the details"
    return str(exc) or type(exc).__name__


def error_response(exc: BaseException) -> JSONResponse:
    status = status_for(exc)
    if status >= 500:
        log.exception("internal error", exc_info=exc)
    return JSONResponse({"error": error_message(exc)}, status_code=status)


async def handle_ferry_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


async def read_json(request: Request) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it; a body over
    the app's limit is a 413 (TooLarge)."""
    body = await read_limited(request, body_limit(request))
    if not body:
        return {}
    try:
        data = bounded_json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, bounded_json.JSONLimitError) as exc:
        raise APIError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def body_limit(request: Request) -> int:
    """The app's `max_request_body_bytes` (FERRY_MAX_REQUEST_BYTES); the app builder sets it."""
    return int(request.app.state.settings.max_request_body_bytes)


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in: a declared or actual size over `limit` is refused
    before more than `limit` bytes are held, so a huge body never fills memory."""
    declared = saturating_decimal(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise TooLarge("request body", limit)
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge("request body", limit)
        parts.append(chunk)
    return b"".join(parts)


def require_str(data: dict, *keys: str) -> str:
    """The first non-empty string among `keys` (e.g. `model` then its legacy alias `name`)."""
    for key in keys:
        value = data.get(key)
        if isinstance(value, str) and value:
            return value
        if value is not None and not isinstance(value, str):
            raise APIError(400, f"{key} must be a string")
    raise APIError(400, f"{keys[0]} is required")
