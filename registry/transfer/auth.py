"""Registry auth: the Bearer challenge, Basic credentials and Ollama's Ed25519 key (reference 1.8).

A 401 carries `WWW-Authenticate: Bearer realm=...,service=...,scope=...`. The token is fetched
from the realm, which must be on the registry's own host (so a registry cannot make the client
sign requests for, or send passwords to, anyone else), with either the user's Basic credentials
for that registry (`ferry login`, `~/.ferry/credentials.json`) or a signature by the user's
Ed25519 key (`~/.ferry/id_ed25519`, created 0600 on first use), as Ollama does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry.transfer.errors import AuthFailed, UpstreamError
from registry.transfer.session import SafeSession

_PARAM = re.compile(r'([A-Za-z_]+)=(?:"([^"]*)"|([^,\s]*))')
EMPTY_BODY_HASH = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()


@dataclass(frozen=True)
class Challenge:
    scheme: str
    params: dict[str, str]


def parse_challenge(header: str) -> Challenge:
    """`Bearer realm="…",service="…",scope="…"` (quoted or bare values) into its parts."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _PARAM.finditer(rest)}
    return Challenge(scheme.lower(), params)


# -- credentials -------------------------------------------------------------------------------

def load_credentials(path: Path, registry: str) -> tuple[str, str] | None:
    """(username, password) saved by `ferry login` for `registry` (host[:port]), or None."""
    auths = _read_auths_file(path).get("auths")
    entry = auths.get(registry.lower()) if isinstance(auths, dict) else None
    if not isinstance(entry, dict):
        return None
    user, password = entry.get("username"), entry.get("password")
    if isinstance(user, str) and isinstance(password, str):
        return user, password
    return None


def _read_auths_file(path: Path) -> dict[str, Any]:
    """The credentials file's JSON object; an absent or unreadable file is an empty one."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_auths_file(path: Path, data: dict[str, Any]) -> None:
    """Replace the file atomically, created 0600 so no other user can read the passwords."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def save_credentials(path: Path, registry: str, username: str, password: str) -> None:
    """Add or replace one registry's credentials."""
    data = _read_auths_file(path)
    auths = data.get("auths")
    if not isinstance(auths, dict):
        auths = data["auths"] = {}
    auths[registry.lower()] = {"username": username, "password": password}
    _write_auths_file(path, data)


def remove_credentials(path: Path, registry: str) -> bool:
    """Forget one registry's credentials (`ferry logout`); False when none were saved."""
    data = _read_auths_file(path)
    auths = data.get("auths")
    if not isinstance(auths, dict) or registry.lower() not in auths:
        return False
    del auths[registry.lower()]
    _write_auths_file(path, data)
    return True


def basic_header(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


# -- the Ed25519 key ---------------------------------------------------------------------------

def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The user's key in OpenSSH format; created (0600, with a .pub beside it) on first use."""
    if not path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
        path.parent.mkdir(parents=True, exist_ok=True)
        # Two processes creating the key at once: the loser uses the winner's file.
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(pem)
            pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                serialization.PublicFormat.OpenSSH)
            path.with_name(path.name + ".pub").write_bytes(pub + b"\n")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise AuthFailed(f"permissions {mode:04o} for {path} are too open; run chmod 600 {path}")
    loaded = serialization.load_ssh_private_key(path.read_bytes(), password=None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise AuthFailed(f"{path} is not an Ed25519 key")
    return loaded


def sign_request(key: Ed25519PrivateKey, method: str, url: str) -> str:
    """Ollama's `Authorization: <ssh pubkey base64>:<signature base64>` for a bodyless request."""
    message = f"{method},{url},{EMPTY_BODY_HASH}".encode()
    signature = base64.b64encode(key.sign(message)).decode()
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                        serialization.PublicFormat.OpenSSH).split()[1].decode()
    return f"{pub}:{signature}"


# -- the token exchange ------------------------------------------------------------------------

class Authenticator:
    """Holds the current `Authorization` value for one registry and refreshes it on a 401."""

    def __init__(self, session: SafeSession, credentials_path: Path, key_path: Path,
                 credentials: tuple[str, str] | None = None) -> None:
        self.session = session
        self.credentials = credentials  # given by `ferry login` before they are saved
        self.registry = session.policy.registry
        self.credentials_path = credentials_path
        self.key_path = key_path
        self.header: str | None = None
        self._lock = asyncio.Lock()

    @property
    def registry_host(self) -> str:
        return self.registry.netloc.decode("ascii").lower()

    async def refresh(self, challenge_header: str, stale: str | None) -> None:
        """Answer a challenge; concurrent 401s with the same stale header fetch one token."""
        async with self._lock:
            if self.header != stale:
                return
            self.header = await self._answer(parse_challenge(challenge_header))

    async def _answer(self, challenge: Challenge) -> str:
        creds = self.credentials or load_credentials(self.credentials_path, self.registry_host)
        if challenge.scheme == "basic":
            if creds is None:
                raise AuthFailed(f"unauthorized: {self.registry_host} wants a username and "
                                 f"password; run `ferry login {self.registry_host}`")
            return basic_header(*creds)
        if challenge.scheme != "bearer" or "realm" not in challenge.params:
            raise AuthFailed(f"unauthorized: unsupported challenge {challenge.scheme!r}")
        url = self._token_url(challenge)
        if creds is not None:
            authorization = basic_header(*creds)
        else:
            key = await asyncio.to_thread(load_or_create_key, self.key_path)
            authorization = sign_request(key, "GET", str(url))
        return "Bearer " + await self._fetch_token(url, authorization)

    def _token_url(self, challenge: Challenge) -> httpx.URL:
        realm = httpx.URL(challenge.params["realm"])
        realm_host = realm.netloc.decode("ascii").lower()
        if realm_host != self.registry_host or realm.scheme != self.registry.scheme:
            raise AuthFailed(f'realm host "{realm.scheme}://{realm_host}" does not match '
                             f'original host "{self.registry.scheme}://{self.registry_host}"')
        query: list[tuple[str, str]] = []
        if challenge.params.get("service"):
            query.append(("service", challenge.params["service"]))
        query += [("scope", s) for s in challenge.params.get("scope", "").split() if s]
        query += [("ts", str(int(time.time()))),
                  ("nonce", base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("="))]
        query.sort(key=lambda kv: kv[0])
        sep = "&" if realm.query else "?"
        return httpx.URL(str(realm) + sep + urlencode(query))

    async def _fetch_token(self, url: httpx.URL, authorization: str) -> str:
        reply = await self.session.send("GET", url, authorization=authorization)
        try:
            body = await reply.response.aread()
        finally:
            await reply.aclose()
        text = body.decode("utf-8", "replace")
        if reply.status in (401, 403):
            raise AuthFailed(f"unauthorized: the token service refused the credentials "
                             f"({reply.status}: {text.strip()[:200]})")
        if reply.status >= 400:
            raise UpstreamError(reply.status, text, str(url))
        try:
            data = json.loads(body)
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise AuthFailed(f"the token endpoint {url.host} returned no token")
        return token
