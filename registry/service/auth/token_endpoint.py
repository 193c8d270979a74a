"""`GET /token`: the distribution token spec's endpoint.

Authenticates the caller by Basic credentials, by Ollama's Ed25519 request signature, or not at
all (anonymous), then grants the intersection of the requested scopes and what the access rules
allow. Wrong credentials are a 401 (never a quiet anonymous token: `ferry login` relies on it);
a valid signature from a key no user holds is anonymous, as a public registry treats it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from registry.service.auth.gate import Gate, gate_of
from registry.service.auth.passwords import check_password
from registry.service.auth.scopes import CATALOG, Scope, ScopeInvalid, parse_scopes
from registry.service.auth.signatures import SignatureInvalid, looks_signed
from registry.service.auth.tokens import MAX_AUTHORIZATION
from registry.service.errors import RegistryError

ANONYMOUS_SUBJECT = ""


async def token(request: Request) -> Response:
    gate = gate_of(request)
    if gate is None:
        raise RegistryError("UNSUPPORTED", "this registry is open: it issues no tokens")
    service = request.query_params.get("service")
    if service is not None and service != gate.config.service:
        raise RegistryError("UNAUTHORIZED", f"this registry's service is "
                            f"{gate.config.service!r}, not {service[:100]!r}")
    try:
        wanted = parse_scopes(request.query_params.getlist("scope"))
    except ScopeInvalid as exc:
        raise RegistryError("SCOPE_INVALID", str(exc)) from None
    subject = await _authenticate(gate, request)
    request.state.audit_subject = subject
    issued = gate.tokens.issue(subject, _grant(gate, subject, wanted))
    return JSONResponse({"token": issued.token, "access_token": issued.token,
                         "expires_in": issued.expires_in, "issued_at": issued.issued_at},
                        headers={"Cache-Control": "no-store"})


def _grant(gate: Gate, subject: str, wanted: list[Scope]) -> list[Scope]:
    granted: list[Scope] = []
    for scope in wanted:
        if (scope.type, scope.name) == CATALOG:
            granted.append(scope)  # anyone may ask; the listing shows only what they may pull
            continue
        actions = scope.actions & gate.config.allowed(subject, scope.name)
        if actions:
            granted.append(Scope(scope.type, scope.name, frozenset(actions)))
    return granted


async def _authenticate(gate: Gate, request: Request) -> str:
    header = request.headers.get("authorization", "")
    if not header:
        return ANONYMOUS_SUBJECT
    if len(header) > MAX_AUTHORIZATION:
        raise _refused("the Authorization header is too long")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "basic":
        return await _basic(gate, value.strip())
    if looks_signed(header):
        return _signed(gate, request, header)
    raise _refused("unsupported Authorization: use Basic credentials or an Ed25519 signature")


async def _basic(gate: Gate, value: str) -> str:
    try:
        text = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        raise _refused("malformed Basic credentials") from None
    name, sep, password = text.partition(":")
    if not sep or not name:
        raise _refused("malformed Basic credentials")
    user = gate.config.users.get(name)
    stored = user.password_hash if user else None
    if not await asyncio.to_thread(check_password, password, stored):
        raise _refused("wrong username or password")
    return name


def _signed(gate: Gate, request: Request, header: str) -> str:
    url = gate.realm(request)
    query = request.scope.get("query_string", b"").decode("latin-1")
    signed_url = f"{url}?{query}" if query else url
    params = request.query_params
    try:
        key = gate.signatures.verify(header, signed_url, params.get("ts"), params.get("nonce"))
    except SignatureInvalid as exc:
        raise _refused(str(exc)) from None
    return gate.config.by_key.get(key, ANONYMOUS_SUBJECT)


def _refused(reason: str) -> RegistryError:
    return RegistryError("UNAUTHORIZED", reason,
                         headers={"WWW-Authenticate": 'Basic realm="ferry-registry"'})


routes = [Route("/token", token, methods=["GET"])]
