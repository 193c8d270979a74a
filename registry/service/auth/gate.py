"""The check every /v2 route makes: does the caller's token grant this action on this repository?

`Gate` lives on `app.state.auth`; an open registry has none, and every check passes. A request
without a token that covers the route gets 401 with the Bearer challenge that sends the client to
`/token` for the scope it needs (keeping the actions its token already holds on that repository,
so a client alternating HEAD and PUT does not trade one grant for the other; reads ask for push
as well, for clients that fetch one token per repository and never refresh it).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.types import Scope as ASGIScope

from registry.service.auth.config import AuthConfig
from registry.service.auth.scopes import (
    CATALOG,
    Scope,
    granted_actions,
    has_catalog,
)
from registry.service.auth.signatures import SignatureChecker
from registry.service.auth.tokens import Claims, Tokens
from registry.service.errors import RegistryError

_CLAIMS = "auth_claims"  # the request state's key for the verified claims
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


class Gate:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self.tokens = Tokens(config.signing_key, config.verify_keys, config.service,
                             config.lifetime)
        self.signatures = SignatureChecker()

    def realm(self, conn: HTTPConnection) -> str:
        """Where clients fetch tokens: the configured realm, else this server as they reach it."""
        if self.config.realm:
            return self.config.realm
        host = conn.headers.get("host", "")
        if not _HOST.match(host):
            server = conn.scope.get("server") or ("127.0.0.1", 5000)
            host = f"{server[0]}:{server[1]}"
        return f"{conn.url.scheme}://{host}/token"

    def claims(self, conn: HTTPConnection) -> Claims | None:
        """The verified claims of the request behind `conn`, None without a valid token."""
        return self.claims_of(conn.scope)

    def claims_of(self, scope: ASGIScope) -> Claims | None:
        """The request's verified token claims, worked out once per request (the access
        middleware asks first, on the raw ASGI scope: no Request or Headers object for it)."""
        state = scope.setdefault("state", {})
        if _CLAIMS in state:
            return state[_CLAIMS]  # type: ignore[no-any-return]
        claims = None
        for name, value in scope["headers"]:  # ASGI names are lower-case; the first one counts
            if name == b"authorization":
                claims = self.tokens.verify_bearer(value)
                break
        state[_CLAIMS] = claims
        return claims

    def challenge(self, conn: HTTPConnection, scope: Scope | None, presented: bool
                  ) -> RegistryError:
        value = f'Bearer realm="{self.realm(conn)}",service="{self.config.service}"'
        if scope is not None:
            value += f',scope="{scope.header()}"'
        if presented:
            value += ',error="insufficient_scope"' if scope else ',error="invalid_token"'
        detail: Any = [scope.claim()] if scope else None
        return RegistryError("UNAUTHORIZED", detail=detail, headers={"WWW-Authenticate": value})


def gate_of(conn: HTTPConnection) -> Gate | None:
    return getattr(conn.app.state, "auth", None)


def authorize(request: Request, repo: str, action: str) -> None:
    """Raise the 401 challenge unless the caller's token grants `action` on `repo`."""
    state = request.scope.setdefault("state", {})  # what request.state writes, minus a State
    state["audit_repository"] = repo
    state["audit_action"] = action
    claims = state.get(_CLAIMS)  # only a Gate puts claims there, after verifying the token
    if claims is not None and claims.allows(repo, action):
        return  # the common case: the access middleware verified the token already
    gate = gate_of(request)
    if gate is None:
        return
    claims = gate.claims_of(request.scope)
    if claims is not None and claims.allows(repo, action):
        return
    held = granted_actions(claims.access, repo) if claims else set()
    # Reads and writes ask for both: clients that keep their first token for a repository
    # (oras-py) then push after a HEAD without a second token; /token grants only what the
    # rules allow, so a reader still gets pull alone.
    wanted = {action} | ({"pull", "push"} if action in ("pull", "push") else set())
    raise gate.challenge(request, Scope("repository", repo, frozenset(held | wanted)),
                         presented="authorization" in request.headers)


def require_token(request: Request) -> None:
    """`GET /v2/`: any valid token (anonymous ones too) answers 200, else the bare challenge."""
    gate = gate_of(request)
    if gate is not None and gate.claims(request) is None:
        raise gate.challenge(request, None, presented="authorization" in request.headers)


def visible_repositories(request: Request, repos: list[str]) -> list[str]:
    """The catalog as the caller may see it: only repositories its subject may pull."""
    gate = gate_of(request)
    if gate is None:
        return repos
    claims = gate.claims(request)
    if claims is None or not has_catalog(claims.access):
        raise gate.challenge(request, Scope(*CATALOG, frozenset({"*"})),
                             presented="authorization" in request.headers)
    return [r for r in repos if "pull" in gate.config.allowed(claims.subject, r)]


def mount_source(request: Request, repo: str, source: str | None) -> str | None:
    """Where a cross-repository mount may take a blob from. Open registry: `source`, or anywhere
    (None). With auth: `source` only when the caller may pull it; otherwise `repo` itself, so the
    mount succeeds only for a blob the caller's repository already holds and never leaks one."""
    gate = gate_of(request)
    if gate is None:
        return source
    claims = gate.claims(request)
    if source is not None and claims is not None and claims.allows(source, "pull"):
        return source
    return repo
