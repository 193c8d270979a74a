"""Before a request reaches a route: who is calling, and are they within their limits; after:
the audit line for every write and every denial."""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from registry.service.auth.audit import AuditLog
from registry.service.auth.gate import Gate
from registry.service.auth.limits import LimitSettings, RequestBuckets, UploadSlots, retry_after
from registry.service.errors import RegistryError, error_response

_UPLOAD_START = re.compile(r"^/v2/.+/blobs/uploads/?$")
_UPLOAD_SESSION = re.compile(r"^/v2/.+/blobs/uploads/([^/]+)$")
_REFERENCE = re.compile(r"^/v2/.+/(?:manifests|blobs)/([^/]+)$")
_READS = ("GET", "HEAD", "OPTIONS")
_DENIALS = (401, 403, 429)


class AccessMiddleware:
    def __init__(self, app: ASGIApp, gate: Gate | None, limits: LimitSettings,
                 audit: AuditLog | None) -> None:
        self.app, self.gate, self.audit = app, gate, audit
        burst = limits.burst or max(1, int(limits.rate * 10))
        self.buckets = RequestBuckets(limits.rate, burst) if limits.rate > 0 else None
        self.uploads = (UploadSlots(limits.max_uploads, limits.upload_ttl)
                        if limits.max_uploads > 0 else None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        subject, address = self._identify(conn)
        client = subject or address
        refusal = self._over_limit(conn, client)
        status: list[int] = []

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                self._track_upload(conn, client, message)
            await send(message)

        try:
            if refusal is not None:
                await error_response(refusal)(scope, receive, send_and_watch)
            else:
                await self.app(scope, receive, send_and_watch)
        finally:
            self._record(conn, subject, address, status[0] if status else 500)

    def _identify(self, conn: HTTPConnection) -> tuple[str, str]:
        address = conn.client.host if conn.client else "unknown"
        claims = self.gate.claims(conn) if self.gate is not None else None
        return (claims.subject if claims else ""), address

    def _over_limit(self, conn: HTTPConnection, client: str) -> RegistryError | None:
        if self.buckets is not None:
            wait = self.buckets.take(client)
            if wait > 0:
                return RegistryError("TOOMANYREQUESTS", "request rate limit exceeded",
                                     headers={"Retry-After": retry_after(wait)})
        if (self.uploads is not None and conn.scope["method"] == "POST"
                and _UPLOAD_START.match(conn.scope["path"]) and self.uploads.full(client)):
            return RegistryError("TOOMANYREQUESTS", f"at most {self.uploads.limit} open "
                                 "upload sessions per client; finish or cancel one",
                                 headers={"Retry-After": "5"})
        return None

    def _track_upload(self, conn: HTTPConnection, client: str, message: Message) -> None:
        if self.uploads is None:
            return
        method, path, code = conn.scope["method"], conn.scope["path"], message["status"]
        if method == "POST" and code == 202:
            for name, value in message.get("headers", []):
                if name.lower() == b"docker-upload-uuid":
                    self.uploads.opened(client, value.decode("latin-1"))
        elif method in ("PUT", "DELETE") and code in (201, 204):
            session = _UPLOAD_SESSION.match(path)
            if session:
                self.uploads.closed(client, session.group(1))

    def _record(self, conn: HTTPConnection, subject: str, address: str, status: int) -> None:
        method = conn.scope["method"]
        if self.audit is None or (method in _READS and status not in _DENIALS):
            return
        state: dict[str, Any] = conn.scope.get("state", {})
        path: str = conn.scope["path"]
        reference = _REFERENCE.match(path)
        self.audit.write(
            subject=state.get("audit_subject", subject) or "anonymous", address=address,
            method=method, action=state.get("audit_action"), path=path[:300],
            repository=state.get("audit_repository"),
            reference=reference.group(1)[:200] if reference else None,
            digest=_digest_param(conn), status=status)


def _digest_param(conn: HTTPConnection) -> str | None:
    if b"digest=" not in conn.scope.get("query_string", b""):
        return None  # most requests: skip parsing the query
    return (conn.query_params.get("digest") or "")[:100] or None
