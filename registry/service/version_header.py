"""`Docker-Distribution-API-Version: registry/2.0` on every response, errors included.

Clients (docker, oras) look for it on `/v2/` to know they speak to a distribution registry. An
open registry adds it with `APIVersionHeader`; an authenticated one has the access middleware
add it (`add_version_header`) in the same pass, so each request crosses one layer, not two.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

VERSION_HEADER = (b"docker-distribution-api-version", b"registry/2.0")


def add_version_header(message: Message) -> None:
    """Put the header on a response's start message (once, whoever else set it)."""
    if message["type"] == "http.response.start":
        headers = list(message.get("headers", []))
        if not any(name == VERSION_HEADER[0] for name, _ in headers):
            headers.append(VERSION_HEADER)
        message["headers"] = headers


class APIVersionHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            add_version_header(message)
            await send(message)

        await self.app(scope, receive, send_with_header)
