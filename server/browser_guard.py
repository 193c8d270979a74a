"""Keeps web pages from driving the model server (CSRF and DNS rebinding).

Any page the user opens can send requests to `http://127.0.0.1:11434`. Three checks stop it:

- `Origin`: a request without one comes from a CLI or a script and passes; a browser's must
  match an allowed origin (the loopback ones and the app schemes Ollama allows, plus
  `FERRY_ORIGINS` globs). CORS headers (preflights too) go only to allowed origins, through
  Starlette's CORSMiddleware, which this guard wraps.
- `Host`: on a loopback listener only loopback names and addresses are served, so a page whose
  name was rebound to 127.0.0.1 (and whose requests carry its own name) gets 403. On any other
  address `FERRY_ALLOWED_HOSTS` decides, when the operator set it.
- Bodies: the content types a browser may send cross-site without a preflight (`text/plain`,
  form encodings) are refused on every state-changing method. URL-encoded bodies from clients
  that are not browsers (no `Origin`, no `Sec-Fetch-*`) pass, because `curl -d '{...}'` sends
  JSON under that type and Ollama's documentation uses it everywhere.

Refusals are 403 (origin, host) or 415 (body type) with Ollama's `{"error": "..."}`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "[::1]")
APP_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# The content types a browser sends cross-site without asking first (the CORS safelist).
BROWSER_FORM_TYPES = ("text/plain", "multipart/form-data")
URLENCODED = "application/x-www-form-urlencoded"


def default_origins() -> list[str]:
    """Loopback pages on any port, both schemes, and the desktop-app schemes."""
    found = []
    for host in LOOPBACK_ORIGIN_HOSTS:
        for scheme in ("http", "https"):
            found += [f"{scheme}://{host}", f"{scheme}://{host}:*"]
    return found + list(APP_ORIGINS)


def origin_regex(patterns: Sequence[str]) -> str:
    """One regex that fully matches any of the `patterns` (case-insensitive), where `*` is the
    only wildcard (so `[::1]` is a literal address, not a character class)."""
    parts = [".*".join(map(re.escape, p.strip().split("*"))) for p in patterns if p.strip()]
    return "(?i:" + "|".join(parts) + ")" if parts else r"(?!)"


def is_loopback_host(host: str) -> bool:
    """`localhost`, `*.localhost`, 127.0.0.0/8 or ::1 (the port already removed)."""
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host_header(value: str) -> str:
    """The host part of a `Host` header: `[::1]:80` -> `::1`, `name:80` -> `name`."""
    value = value.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


class BrowserGuard:
    """ASGI middleware: the three checks above, then CORS for allowed origins."""

    def __init__(self, app: ASGIApp, bind_host: str, origins: Sequence[str] = (),
                 allowed_hosts: Sequence[str] = ()) -> None:
        self.origin_pattern = re.compile(origin_regex([*default_origins(), *origins]))
        self.loopback_only = is_loopback_host(bind_host)
        self.host_pattern = (re.compile(origin_regex(allowed_hosts)) if allowed_hosts else None)
        self.app = CORSMiddleware(
            app, allow_origin_regex=self.origin_pattern.pattern, allow_methods=["*"],
            allow_headers=["*"], expose_headers=["*"], max_age=600)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        problem = self.refusal(scope["method"], headers)
        if problem is not None:
            status, message = problem
            await JSONResponse({"error": message}, status_code=status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, method: str, headers: Headers) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        if not self.host_allowed(split_host_header(headers.get("host", ""))):
            return 403, "this server does not answer requests addressed to that host"
        origin = headers.get("origin")
        if origin is not None and not self.origin_pattern.fullmatch(origin):
            return 403, "requests from this origin are not allowed (see FERRY_ORIGINS)"
        if method in STATE_CHANGING and not self.body_type_allowed(headers):
            return 415, "request bodies must be application/json"
        return None

    def host_allowed(self, host: str) -> bool:
        if not host or is_loopback_host(host):  # no Host at all: an HTTP/1.0 tool, no browser
            return True
        if self.loopback_only:
            return False
        return self.host_pattern is None or bool(self.host_pattern.fullmatch(host))

    @staticmethod
    def body_type_allowed(headers: Headers) -> bool:
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type in BROWSER_FORM_TYPES:
            return False
        if media_type == URLENCODED:
            from_browser = "origin" in headers or any(
                key.startswith("sec-fetch-") for key in headers)
            return not from_browser
        return True
