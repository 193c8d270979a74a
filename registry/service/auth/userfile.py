"""`ferry registry user add`: add a user to the auth file, creating the file and key if needed.

A new user is appended as its own `[users.NAME]` table, so the operator's comments and layout
stay as they were; the result is loaded with the same checks as start-up before it replaces the
file (atomically, 0600: it holds password hashes).
"""

from __future__ import annotations

import os
import re
import secrets
import tomllib
from pathlib import Path

import tomli_w
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry.service.auth.config import ANONYMOUS, AuthConfigError, load_auth_config
from registry.service.auth.passwords import hash_password

KEY_FILE = "token-key.pem"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_TEMPLATE = f"""\
# ferry registry auth file (see `ferry registry serve --help`).
[token]
signing_key = "{KEY_FILE}"  # Ed25519 private key; keep it secret, share it between replicas
lifetime = 300

# [access."library/*"]
# anonymous = ["pull"]
# publishers = ["pull", "push"]
"""


def write_signing_key(path: Path) -> None:
    """A new Ed25519 private key (PEM, 0600); an existing file is kept."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def add_user(path: Path, name: str, password: str | None, keys: list[str],
             groups: list[str]) -> None:
    if not _NAME.match(name) or name == ANONYMOUS:
        raise ValueError(f"user name {name!r}: letters, digits, '.', '_', '-' (not 'anonymous')")
    if not password and not keys:
        raise ValueError("a user needs a password, a --key, or both")
    text = path.read_text(encoding="utf-8") if path.exists() else _TEMPLATE
    if name in tomllib.loads(text).get("users", {}):
        raise ValueError(f"user {name!r} already exists in {path}; edit the file to change it")
    if not path.exists() and not (path.parent / KEY_FILE).exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_signing_key(path.parent / KEY_FILE)
    entry: dict[str, object] = {}
    if password:
        entry["password"] = hash_password(password)
    if keys:
        entry["keys"] = keys
    if groups:
        entry["groups"] = groups
    text = text.rstrip("\n") + "\n\n" + tomli_w.dumps({"users": {name: entry}})
    _replace_checked(path, text)


def _replace_checked(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        try:
            load_auth_config(tmp)
        except AuthConfigError as exc:
            raise ValueError(str(exc).replace(str(tmp), str(path))) from None
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
