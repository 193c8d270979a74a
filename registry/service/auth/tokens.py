"""Bearer tokens: JWTs signed with Ed25519 (EdDSA) by PyJWT, bound to the service (`aud`).

Every replica holding the same key file verifies every other replica's tokens. During a key
rotation the config lists the old public key in `verify_keys`, so tokens signed by either key
verify until the old ones expire. A verified token is cached until it expires: clients reuse one
token for many requests, and the signature check is the costly part of a small request.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from registry.service.auth.scopes import Scope

ISSUER = "ferry-registry"
LEEWAY = 10  # seconds of clock skew tolerated between replicas
_CACHE_LIMIT = 10000


def key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.urlsafe_b64encode(hashlib.sha256(raw).digest()[:12]).decode()


@dataclass(frozen=True)
class Claims:
    subject: str  # "" for anonymous
    access: list[dict[str, Any]]
    expires: float


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
        self._cache: dict[str, Claims] = {}

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
        cached = self._cache.get(token)
        if cached is not None:
            return cached if cached.expires + LEEWAY > time.time() else None
        claims = self._decode(token)
        if claims is not None:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[token] = claims
        return claims

    def _decode(self, token: str) -> Claims | None:
        try:
            kid = jwt.get_unverified_header(token).get("kid")
        except jwt.InvalidTokenError:
            return None
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
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
        return Claims(subject, access, float(data["exp"]))
