"""Progress streams for long operations (pull, push, create), per reference 4.1.

An operation is an async iterator of progress dicts. With `stream` true the client gets NDJSON,
one object per line; an error before the first line becomes a normal HTTP error, an error after
it a final `{"error": ...}` line. With `stream` false the client gets the last message alone, or
the error with its status. A client that disconnects cancels the operation (the iterator is
closed, so its `finally` blocks clean up).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.api_errors import error_message, error_response

NDJSON = "application/x-ndjson"



def ndjson_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


async def progress_response(request: Request, events: AsyncIterator[dict[str, Any]],
                            stream: bool) -> Response:
    """Run `events` and render it as NDJSON or as its last message."""
    if not stream:
        last: dict[str, Any] = {}
        try:
            async for event in events:
                last = event
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(last)

    try:
        first = await anext(events)
    except StopAsyncIteration:
        return Response(status_code=200, media_type=NDJSON)
    except Exception as exc:
        return error_response(exc)

    async def body() -> AsyncIterator[bytes]:
        try:
            yield ndjson_line(first)
            async for event in events:
                yield ndjson_line(event)
        except Exception as exc:
            yield ndjson_line({"error": error_message(exc)})
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type=NDJSON)
