"""Purpose-built servers for the transfer tests, all on loopback.

- `BlobCDN`: serves a store's blobs at `/blobs/<digest>` with Range, counts bytes, records the
  headers it saw, and can be slowed down, made to corrupt a blob, or cut off mid-body.
- `RedirectBlobs`: middleware for the real registry service that answers blob GETs with a 307 to
  the CDN, as a registry in front of object storage does.
- `FailEverySecondPatch`: middleware that forwards only the first half of every second PATCH to
  the real registry, then answers 500, so the client must ask for the session's offset.
- `TokenAuth`: middleware demanding a Bearer token that a `/token` realm issues for a valid
  Ed25519 signature or Basic password.
- `hops_app`: `/loop` redirects to itself, `/to?u=` redirects anywhere, `/ok` answers; counts hits.
"""

from __future__ import annotations

import asyncio
import base64
import re
from collections import Counter
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from registry.digests import Digest
from registry.store import Store

_BLOB_PATH = re.compile(r"^/v2/(.+)/blobs/(sha256:[0-9a-f]{64})$")


class BlobCDN:
    """A blob CDN over a store's files (the CDN must not need the registry's credentials)."""

    def __init__(self, store: Store, chunk: int = 64 * 1024) -> None:
        self.store = store
        self.chunk = chunk
        self.bytes_served = 0
        self.requests: list[dict[str, str]] = []
        self.delay = 0.0
        self.corrupt: set[str] = set()
        self.cut_after: int | None = None  # close each body after this many bytes
        self.active = 0
        self.max_active = 0
        self.stall_once = 0.0  # the next body goes silent this long after its first chunk
        self.app = Starlette(routes=[Route("/blobs/{digest}", self.blob, methods=["GET"])])

    async def blob(self, request: Request) -> Response:
        self.requests.append({k.lower(): v for k, v in request.headers.items()})
        digest = Digest.parse(request.path_params["digest"])
        data = self.store.blob_path(digest).read_bytes()
        if str(digest) in self.corrupt:
            data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
        start, end, status = 0, len(data) - 1, 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("range", ""))
        if match:
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else end
            status = 206
        body = data[start:end + 1]
        headers = {"Content-Length": str(len(body))}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        return StreamingResponse(self._stream(body), status_code=status, headers=headers)

    async def _stream(self, body: bytes):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            sent = 0
            for offset in range(0, len(body), self.chunk):
                piece = body[offset:offset + self.chunk]
                if self.cut_after is not None and sent + len(piece) > self.cut_after:
                    return  # the connection ends short of Content-Length
                if self.delay:
                    await asyncio.sleep(self.delay)
                if sent and self.stall_once:
                    stall, self.stall_once = self.stall_once, 0.0
                    await asyncio.sleep(stall)
                sent += len(piece)
                self.bytes_served += len(piece)
                yield piece
        finally:
            self.active -= 1


class RedirectBlobs:
    """Answer `GET /v2/<repo>/blobs/<digest>` with a 307 to `cdn_base/blobs/<digest>?sig=...`."""

    def __init__(self, app: ASGIApp, cdn_base: str) -> None:
        self.app = app
        self.cdn_base = cdn_base
        self.redirected = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _BLOB_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match and scope["method"] == "GET":
            self.redirected += 1
            url = f"{self.cdn_base}/blobs/{match.group(2)}?sig=secret"
            await RedirectResponse(url, status_code=307)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestLog:
    """Records (method, path, query) of every request, and the Authorization header seen."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests: list[tuple[str, str, str]] = []
        self.authorizations: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.requests.append((scope["method"], scope["path"],
                                  scope.get("query_string", b"").decode()))
            headers = dict((k.decode().lower(), v.decode()) for k, v in scope["headers"])
            self.authorizations.append(headers.get("authorization", ""))
        await self.app(scope, receive, send)

    def count(self, method: str, fragment: str = "") -> int:
        return sum(1 for m, path, _q in self.requests if m == method and fragment in path)

    def uploads(self) -> int:
        """Requests that carried blob bytes: a session's PATCHes and whole-blob POSTs."""
        return self.count("PATCH") + sum(
            1 for m, _p, q in self.requests if m == "POST" and "digest=" in q and "mount=" not in q)


class FailEverySecondPatch:
    """Every second PATCH: forward its first half to the registry, then answer 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.patches = 0
        self.failed = 0
        self.status_checks = 0
        self.ranges: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and "/blobs/uploads/" in scope["path"]:
            self.status_checks += 1
        if scope["method"] != "PATCH":
            await self.app(scope, receive, send)
            return
        self.patches += 1
        headers = dict((k.decode().lower(), v.decode()) for k, v in scope["headers"])
        self.ranges.append(headers.get("content-range", ""))
        if self.patches % 2:
            await self.app(scope, receive, send)
            return
        self.failed += 1
        body = await _read_body(receive)
        start = int(headers["content-range"].split("-")[0])
        half = body[: len(body) // 2]
        await self._forward(scope, half, start)
        await PlainTextResponse("injected failure", status_code=500)(scope, receive, send)

    async def _forward(self, scope: Scope, body: bytes, start: int) -> None:
        if not body:
            return
        headers = [(k, v) for k, v in scope["headers"]
                   if k.lower() not in (b"content-length", b"content-range")]
        headers += [(b"content-length", str(len(body)).encode()),
                    (b"content-range", f"{start}-{start + len(body) - 1}".encode())]
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def discard(message: Message) -> None:
            return None

        await self.app({**scope, "headers": headers}, receive, discard)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


class TokenAuth:
    """Demand `Bearer <token>` on /v2/; `/token` issues it for a valid key signature or password.

    `realm` is what the challenge names (tests point it elsewhere to prove the host check).
    """

    TOKEN = "token-for-tests"

    def __init__(self, app: ASGIApp, realm: str, password: tuple[str, str] | None = None) -> None:
        self.app = app
        self.realm = realm
        self.password = password
        self.token_requests: list[dict[str, Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if scope["path"] == "/token":
            await self._token(request)(scope, receive, send)
            return
        if request.headers.get("authorization") != f"Bearer {self.TOKEN}":
            challenge = (f'Bearer realm="{self.realm}",service="ferry-test",'
                         f'scope="repository:ns/model:pull,push"')
            await JSONResponse({"errors": [{"code": "UNAUTHORIZED", "message": "auth"}]},
                               status_code=401,
                               headers={"WWW-Authenticate": challenge})(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _token(self, request: Request) -> Response:
        auth = request.headers.get("authorization", "")
        self.token_requests.append({"authorization": auth, "url": str(request.url),
                                    "query": dict(request.query_params)})
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            if self.password == (user, password):
                return JSONResponse({"token": self.TOKEN})
            return JSONResponse({"error": "bad password"}, status_code=401)
        if _valid_signature(auth, str(request.url)):
            return JSONResponse({"token": self.TOKEN})
        return JSONResponse({"error": "bad signature"}, status_code=401)


def _valid_signature(auth: str, url: str) -> bool:
    from registry.transfer.auth import EMPTY_BODY_HASH

    try:
        pub, signature = auth.split(":", 1)
        key = load_ssh_public_key(f"ssh-ed25519 {pub}".encode())
        assert isinstance(key, Ed25519PublicKey)
        key.verify(base64.b64decode(signature), f"GET,{url},{EMPTY_BODY_HASH}".encode())
    except Exception:
        return False
    return True


def hops_app() -> tuple[Starlette, Counter]:
    """Redirect endpoints for the hop-policy tests, with a hit counter per path."""
    hits: Counter = Counter()

    async def loop(request: Request) -> Response:
        hits["/loop"] += 1
        return RedirectResponse("/loop", status_code=302)

    async def to(request: Request) -> Response:
        hits["/to"] += 1
        return RedirectResponse(request.query_params["u"], status_code=307)

    async def ok(request: Request) -> Response:
        hits["/ok"] += 1
        hits["host:" + request.headers.get("host", "")] += 1
        return PlainTextResponse("ok")

    routes = [Route("/loop", loop), Route("/to", to), Route("/ok", ok)]
    return Starlette(routes=routes), hits
