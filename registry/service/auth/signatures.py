"""Ollama's key-signed token request: `Authorization: <ssh key base64>:<signature base64>`.

The client signs `GET,<the full token URL>,<base64 of the hex sha256 of an empty body>` with its
Ed25519 key (registry/transfer/auth.py `sign_request`; reference 1.8). The URL carries `ts` (unix
seconds) and a random `nonce`: a signature older or newer than MAX_SKEW seconds is refused, and
a nonce seen within that window is refused once it has been used (per replica).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

EMPTY_BODY_HASH = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()
MAX_SKEW = 300.0
_SIGNED = re.compile(r"^([A-Za-z0-9+/]{20,200}={0,2}):([A-Za-z0-9+/]{80,100}={0,2})$")


MAX_NONCE = 128  # characters of a request's nonce
MAX_NONCES = 10_000  # nonces remembered for replay checks

class SignatureInvalid(ValueError):
    """The header is signed-looking but does not verify; the message is safe to show."""


def looks_signed(authorization: str) -> bool:
    return _SIGNED.match(authorization) is not None


class SignatureChecker:
    def __init__(self, max_skew: float = MAX_SKEW) -> None:
        self.max_skew = max_skew
        self._nonces: dict[str, float] = {}

    def verify(self, authorization: str, url: str, ts: str | None, nonce: str | None) -> str:
        """The signer's key (base64 ssh wire form) when the signature over `url` holds."""
        match = _SIGNED.match(authorization)
        if match is None:
            raise SignatureInvalid("malformed key signature")
        key_b64, sig_b64 = match.groups()
        self._check_freshness(ts, nonce)
        try:
            key = serialization.load_ssh_public_key(f"ssh-ed25519 {key_b64}".encode())
            signature = base64.b64decode(sig_b64, validate=True)
        except (ValueError, binascii.Error, TypeError):
            raise SignatureInvalid("the signing key is not an Ed25519 public key") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SignatureInvalid("the signing key is not an Ed25519 public key")
        try:
            key.verify(signature, f"GET,{url},{EMPTY_BODY_HASH}".encode())
        except InvalidSignature:
            raise SignatureInvalid("the request signature does not verify") from None
        if nonce:
            self._nonces[nonce] = time.time()
        return key_b64

    def _check_freshness(self, ts: str | None, nonce: str | None) -> None:
        now = time.time()
        if ts is None or not ts.isdigit() or abs(now - int(ts)) > self.max_skew:
            raise SignatureInvalid("the signed request's ts is missing or too far from now")
        if nonce is not None and len(nonce) > MAX_NONCE:
            raise SignatureInvalid(f"the signed request's nonce is longer than {MAX_NONCE}")
        if len(self._nonces) > MAX_NONCES:
            # Any key signs (an unknown one is anonymous), so a flood of fresh nonces must not
            # grow the table: expired ones go, and if that is not enough the older half goes
            # (insertion order is time order).
            self._nonces = {n: t for n, t in self._nonces.items() if now - t <= self.max_skew * 2}
            if len(self._nonces) > MAX_NONCES // 2:
                kept = list(self._nonces.items())[-(MAX_NONCES // 2):]
                self._nonces = dict(kept)
        if nonce and nonce in self._nonces:
            raise SignatureInvalid("the signed request was replayed (nonce already used)")
