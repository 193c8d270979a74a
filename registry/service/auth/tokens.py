"""Bearer tokens: JWTs signed with Ed25519 (EdDSA) by PyJWT, bound to the service (`aud`).

Every replica holding the same key file verifies every other replica's tokens. During a key
rotation the config lists the old public key in `verify_keys`, so tokens signed by either key
verify until the old ones expire.

Clients reuse one token for many requests, and decoding plus the Ed25519 check cost more than
the rest of a small request's auth work together, so a verified token is remembered by its exact
string, and a request's token by the exact bytes of its Authorization header when that is the
canonical `Bearer <token>` (so a repeat request skips the header's parsing too; at most
CACHE_LIMIT entries, each no bigger than its token plus 7 bytes, the oldest forgotten first). A
remembered token is still refused once it expires (the same leeway as the full check) or once
the key that signed it is no longer among `keys`; everything else the full check looks at
(signature, audience, issuer, claims) is a function of the string, or the header bytes, alone.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from registry.service.auth.scopes import Scope

ISSUER = "ferry-registry"
LEEWAY = 10  # seconds of clock skew tolerated between replicas
CACHE_LIMIT = 10000  # verified tokens remembered
MAX_AUTHORIZATION = 8192  # bytes of Authorization header read; longer is refused unread


def key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(hashlib.sha256(raw).digest()[:12]).decode()


@dataclass(frozen=True)
class Claims:
    subject: str  # "" for anonymous
    access: list[dict[str, Any]]
    expires: float
    # repository -> granted actions, worked out once per token from `access` (see `allows`)
    grants: dict[str, frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        grants: dict[str, set[str]] = {}
        for entry in self.access:
            if not isinstance(entry, dict) or entry.get("type") != "repository":
                continue
            name, actions = entry.get("name"), entry.get("actions")
            if isinstance(name, str) and isinstance(actions, list):
                grants.setdefault(name, set()).update(a for a in actions if isinstance(a, str))
        object.__setattr__(self, "grants", {k: frozenset(v) for k, v in grants.items()})

    def allows(self, repo: str, action: str) -> bool:
        """Does the `access` claim grant `action` on `repo`? (scopes.covers, precomputed.)"""
        actions = self.grants.get(repo)
        return actions is not None and action in actions


@dataclass(frozen=True)
class IssuedToken:
    token: str
    expires_in: int
    issued_at: str


class Tokens:
    def __init__(self, signing_key: Ed25519PrivateKey, verify_keys: list[Ed25519PublicKey],
                 service: str, lifetime: int) -> None:
        self.signing_key = signing_key
        self.keys = {key_id(k): k for k in verify_keys}
        self.signing_kid = key_id(signing_key.public_key())
        self.service = service
        self.lifetime = lifetime
        # token string, or raw Authorization header value -> (claims, signing kid)
        self._cache: dict[str | bytes, tuple[Claims, str]] = {}

    def issue(self, subject: str, granted: list[Scope]) -> IssuedToken:
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": subject, "aud": self.service, "iat": now, "nbf": now,
                  "exp": now + self.lifetime, "jti": secrets.token_urlsafe(12),
                  "access": [scope.claim() for scope in granted]}
        token = jwt.encode(claims, self.signing_key, algorithm="EdDSA",
                           headers={"kid": self.signing_kid})
        issued = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        return IssuedToken(token, self.lifetime, issued)

    def verify(self, token: str) -> Claims | None:
        """The token's claims when its signature, audience, issuer and times hold, else None."""
        known, claims = self._cached(token)
        return claims if known else self._remember(token, self._decode(token))

    def verify_bearer(self, authorization: bytes) -> Claims | None:
        """The claims of a request's raw `Authorization` value when it is `Bearer <a token
        that verify() accepts>`, else None; remembered by those bytes."""
        cached = self._cache.get(authorization)  # every request asks: the hit is checked here
        if (cached is not None and cached[0].expires + LEEWAY > time.time()
                and cached[1] in self.keys):
            return cached[0]
        known, claims = self._cached(authorization)
        if known:
            return claims
        token = _bearer_token(authorization)
        if token is None:
            return None
        if authorization[:7] != b"Bearer " or len(authorization) != len(token) + 7:
            # Not the canonical form: remembered by the token, so padding (up to
            # MAX_AUTHORIZATION) or case variants of one token cannot fill the cache with
            # entries bigger than the token itself.
            return self.verify(token)
        return self._remember(authorization, self._decode(token))

    def _cached(self, key: str | bytes) -> tuple[bool, Claims | None]:
        """(True, what the full check says now) for a remembered key, else (False, None)."""
        cached = self._cache.get(key)
        if cached is None:
            return False, None
        claims, kid = cached
        if claims.expires + LEEWAY > time.time() and kid in self.keys:
            return True, claims
        del self._cache[key]  # expired, or its key retired: the full check fails too
        return True, None

    def _remember(self, key: str | bytes, decoded: tuple[Claims, str] | None) -> Claims | None:
        if decoded is None:
            return None  # a refused token is not remembered: it gets the full check each time
        if len(self._cache) >= CACHE_LIMIT:  # dicts keep insertion order: drop the oldest
            del self._cache[next(iter(self._cache))]
        self._cache[key] = decoded
        return decoded[0]

    def _decode(self, token: str) -> tuple[Claims, str] | None:
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.InvalidTokenError:
            return None
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None or not isinstance(kid, str):
            return None  # signed by no key of ours (or an unsigned token naming none)
        try:
            data = jwt.decode(token, key, algorithms=["EdDSA"], audience=self.service,
                              issuer=ISSUER, leeway=LEEWAY,
                              options={"require": ["exp", "iat", "aud", "iss", "sub"]})
        except jwt.InvalidTokenError:
            return None
        access = data.get("access")
        subject = data.get("sub")
        if not isinstance(access, list) or not isinstance(subject, str):
            return None
        return Claims(subject, access, float(data["exp"])), kid


def _bearer_token(authorization: bytes) -> str | None:
    """The token of a `Bearer <token>` header value (scheme case-insensitive), else None."""
    if len(authorization) > MAX_AUTHORIZATION or authorization[:7].lower() != b"bearer ":
        return None
    return authorization[7:].strip().decode("latin-1")
