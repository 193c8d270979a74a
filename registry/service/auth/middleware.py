"""Before a request reaches a route: who is calling, and are they within their limits; after:
the audit line for every write and every denial. On the way out it also adds the API version
header to every response (registry/service/version_header.py), in place of a layer of its own."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from registry.service.auth.audit import AuditLog
from registry.service.auth.gate import Gate
from registry.service.auth.limits import LimitSettings, RequestBuckets, UploadSlots, retry_after
from registry.service.errors import ERROR_STATUS, RegistryError, error_response
from registry.service.version_header import add_version_header

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
        # Every request passes here, and most are small reads: it works on the raw scope (no
        # Request, no Headers object) and makes as few calls as the checks allow (a profile of
        # small HEADs counted ~270 Python calls per request in all; auth adds ~15, 5 of them
        # uvicorn reading the Authorization header).
        claims = self.gate.claims_of(scope) if self.gate is not None else None
        subject = claims.subject if claims is not None else ""
        address = scope["client"][0] if scope.get("client") else "unknown"
        client = subject or address

        async def send_with_header(message: Message) -> None:
            add_version_header(message)
            await send(message)

        refusal = None
        if self.buckets is not None and (wait := self.buckets.take(client)) > 0:
            refusal = RegistryError("TOOMANYREQUESTS", "request rate limit exceeded",
                                    headers={"Retry-After": retry_after(wait)})
        elif self.uploads is not None and scope["method"] == "POST":
            refusal = self._over_upload_cap(scope, client)
        if refusal is not None:
            try:
                await error_response(refusal)(scope, receive, send_with_header)
            finally:
                if self.audit is not None:
                    self._record(scope, subject, address, refusal.status)
            return
        if scope["method"] in _READS:
            # A read opens or closes no upload session and is audited only when refused, so
            # its `send` is not watched: a refusal is an error response, whose status
            # `handle_error` notes in the request state.
            try:
                await self.app(scope, receive, send_with_header)
            finally:
                if self.audit is not None:
                    denied = scope.get("state", {}).get(ERROR_STATUS)
                    if denied in _DENIALS:
                        self._record(scope, subject, address, denied)
            return
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                add_version_header(message)
                if self.uploads is not None:
                    self._track_upload(scope, client, message)
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            if self.audit is not None:
                self._record(scope, subject, address, status)

    def _over_upload_cap(self, scope: Scope, client: str) -> RegistryError | None:
        if (self.uploads is not None and _UPLOAD_START.match(scope["path"])
                and self.uploads.full(client)):
            return RegistryError("TOOMANYREQUESTS", f"at most {self.uploads.limit} open "
                                 "upload sessions per client; finish or cancel one",
                                 headers={"Retry-After": "5"})
        return None

    def _track_upload(self, scope: Scope, client: str, message: Message) -> None:
        if self.uploads is None:
            return
        method, path, code = scope["method"], scope["path"], message["status"]
        if method == "POST" and code == 202:
            for name, value in message.get("headers", []):
                if name.lower() == b"docker-upload-uuid":
                    self.uploads.opened(client, value.decode("latin-1"))
        elif method in ("PUT", "DELETE") and code in (201, 204):
            session = _UPLOAD_SESSION.match(path)
            if session:
                self.uploads.closed(client, session.group(1))

    def _record(self, scope: Scope, subject: str, address: str, status: int) -> None:
        if self.audit is None:
            return
        state: dict[str, Any] = scope.get("state", {})
        path: str = scope["path"]
        reference = _REFERENCE.match(path)
        self.audit.write(
            subject=state.get("audit_subject", subject) or "anonymous", address=address,
            method=scope["method"], action=state.get("audit_action"), path=path[:300],
            repository=state.get("audit_repository"),
            reference=reference.group(1)[:200] if reference else None,
            digest=_digest_param(scope), status=status)


def _digest_param(scope: Scope) -> str | None:
    query: bytes = scope.get("query_string", b"")
    if b"digest=" not in query:
        return None  # most requests: skip parsing the query
    # what Starlette's query_params would give, without building a Request for it
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if name == "digest":
            return value[:100] or None
    return None
