"""The /api routes over the local store (Ollama's API, reference 4.3-4.5)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ferry import __version__


async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__})


routes = [
    Route("/api/version", version, methods=["GET"]),
]
