"""The auth file (`ferry registry serve --auth FILE`): users, groups, access rules, token keys.

    [token]
    signing_key = "token-key.pem"     # Ed25519 private key (PEM), relative to this file
    verify_keys = ["old-key.pub.pem"] # more public keys accepted (a rotation in progress)
    lifetime = 300                    # seconds a token lives
    service = "ferry-registry"        # the tokens' audience
    # realm = "https://registry.example.com/token"  # when a proxy changes scheme or host

    [users.alice]
    password = "scrypt$15$8$1$..."    # `ferry registry user add` writes these
    keys = ["ssh-ed25519 AAAAC3... alice@laptop"]
    groups = ["publishers"]

    [groups]
    publishers = ["bob"]              # members, besides users naming the group

    [access."library/*"]              # a glob over repository names (fnmatch, `*` spans `/`)
    anonymous = ["pull"]
    publishers = ["pull", "push"]
    alice = ["pull", "push", "delete"]

A subject's actions on a repository are the union over every rule whose glob matches. Errors
name the file, the line and the reason, so a bad file stops start-up with something to fix.
"""

from __future__ import annotations

import base64
import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from registry.service.auth.passwords import InvalidHash, parse_hash
from registry.service.auth.scopes import ACTIONS

ANONYMOUS = "anonymous"
DEFAULT_LIFETIME = 300
DEFAULT_SERVICE = "ferry-registry"


class AuthConfigError(ValueError):
    """`<file>:<line>: <reason>`; line 0 when the reason has no single place."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")


@dataclass(frozen=True)
class User:
    name: str
    password_hash: str | None
    keys: tuple[str, ...]  # base64 of the ssh wire form (the second field of `ssh-ed25519 …`)
    groups: frozenset[str]


@dataclass(frozen=True)
class AuthConfig:
    path: Path
    users: dict[str, User]
    rules: list[tuple[str, dict[str, frozenset[str]]]]  # (glob, {principal: actions})
    signing_key: Ed25519PrivateKey
    verify_keys: list[Ed25519PublicKey]
    lifetime: int = DEFAULT_LIFETIME
    service: str = DEFAULT_SERVICE
    realm: str = ""
    by_key: dict[str, str] = field(default_factory=dict)  # ssh key base64 -> user name

    def principals(self, subject: str) -> set[str]:
        """The names a rule may use for `subject`: itself, its groups; anonymous for everyone."""
        user = self.users.get(subject)
        return {ANONYMOUS} if user is None else {ANONYMOUS, user.name, *user.groups}

    def allowed(self, subject: str, repo: str) -> set[str]:
        """Every action `subject` ("" for anonymous) may take on `repo`."""
        names = self.principals(subject)
        found: set[str] = set()
        for glob, grants in self.rules:
            if fnmatch.fnmatchcase(repo, glob):
                for name in names & grants.keys():
                    found |= grants[name]
        return found


class _Locator:
    """Finds the line of a key or value in the file's text, for error messages."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.lines = path, text.splitlines()

    def line_of(self, needles: tuple[str, ...], after: str = "") -> int:
        """The first line holding every needle, at or below the first line holding `after`."""
        start = self.line_of((after,)) if after else 1
        for number, line in enumerate(self.lines[max(start, 1) - 1:], max(start, 1)):
            if all(n in line for n in needles):
                return number
        return 0

    def error(self, reason: str, *needles: str, after: str = "") -> AuthConfigError:
        return AuthConfigError(self.path, self.line_of(needles, after) if needles else 0, reason)


def load_auth_config(path: Path) -> AuthConfig:
    """Read and check the whole file; AuthConfigError names what is wrong and where."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(path, 0, f"cannot read the auth file: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        at = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        line = getattr(exc, "lineno", 0) or (int(at.group(1)) if at else 0)
        raise AuthConfigError(path, line, f"not valid TOML: {exc}") from None
    where = _Locator(path, text)
    unknown = set(data) - {"token", "users", "groups", "access"}
    if unknown:
        name = sorted(unknown)[0]
        raise where.error(f"unknown section [{name}] (token, users, groups, access)", name)
    users = _users(_table(data, "users", where), _table(data, "groups", where), where)
    rules = _rules(_table(data, "access", where), users, where)
    return _with_token(path, _table(data, "token", where), users, rules, where)


def _table(data: dict[str, Any], name: str, where: _Locator) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise where.error(f"{name} must be a table ([{name}])", name)
    return value


def _string_list(value: object, what: str, where: _Locator, *needles: str,
                 after: str = "") -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise where.error(f"{what} must be a list of strings", *needles, after=after)
    return value


def _users(table: dict[str, Any], groups: dict[str, Any], where: _Locator) -> dict[str, User]:
    members: dict[str, set[str]] = {}
    for group, names in groups.items():
        for name in _string_list(names, f"group {group!r}", where, group):
            members.setdefault(name, set()).add(group)
    users = {}
    for name, entry in table.items():
        if not isinstance(entry, dict):
            raise where.error(f"user {name!r} must be a table ([users.{name}])", name)
        if name == ANONYMOUS or name in groups:
            raise where.error(f"user name {name!r} is taken by a group or 'anonymous'", name)
        unknown = set(entry) - {"password", "keys", "groups"}
        if unknown:
            raise where.error(f"user {name!r}: unknown field {sorted(unknown)[0]!r}",
                              sorted(unknown)[0], after=name)
        password = entry.get("password")
        if password is not None:
            try:
                parse_hash(password if isinstance(password, str) else "")
            except InvalidHash as exc:
                raise where.error(f"user {name!r}: {exc}", "password", after=name) from None
        keys = tuple(_ssh_key(k, name, where) for k in
                     _string_list(entry.get("keys", []), "keys", where, "keys", after=name))
        own = set(_string_list(entry.get("groups", []), "groups", where, "groups", after=name))
        users[name] = User(name, password, keys, frozenset(own | members.get(name, set())))
    return users


def _ssh_key(text: str, user: str, where: _Locator) -> str:
    """The base64 field of an `ssh-ed25519 AAAA… [comment]` line, checked to be a real key."""
    parts = text.split()
    try:
        if len(parts) < 2 or parts[0] != "ssh-ed25519":
            raise ValueError("not an ssh-ed25519 key")
        key = serialization.load_ssh_public_key(f"{parts[0]} {parts[1]}".encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("not an Ed25519 key")
        base64.b64decode(parts[1], validate=True)
    except (ValueError, TypeError) as exc:
        raise where.error(f"user {user!r}: key {text[:30]!r}… is not an `ssh-ed25519 AAAA…` "
                          f"public key ({exc})", text[:30]) from None
    return parts[1]


def _rules(table: dict[str, Any], users: dict[str, User], where: _Locator
           ) -> list[tuple[str, dict[str, frozenset[str]]]]:
    known = {ANONYMOUS} | set(users) | {g for u in users.values() for g in u.groups}
    rules = []
    for glob, grants in table.items():
        if not isinstance(grants, dict):
            raise where.error(f"access rule {glob!r} must be a table of name = [actions]", glob)
        parsed = {}
        for name, actions in grants.items():
            if name not in known:
                raise where.error(f"access rule {glob!r}: {name!r} is no user, group or "
                                  f"'anonymous'", name, after=glob)
            listed = _string_list(actions, f"actions of {name!r}", where, name, after=glob)
            bad = set(listed) - set(ACTIONS)
            if bad:
                raise where.error(f"access rule {glob!r}: unknown action {sorted(bad)[0]!r} "
                                  f"(pull, push, delete)", name, after=glob)
            parsed[name] = frozenset(listed)
        rules.append((glob, parsed))
    return rules


def _with_token(path: Path, table: dict[str, Any], users: dict[str, User],
                rules: list[tuple[str, dict[str, frozenset[str]]]], where: _Locator
                ) -> AuthConfig:
    unknown = set(table) - {"signing_key", "verify_keys", "lifetime", "service", "realm"}
    if unknown:
        raise where.error(f"[token]: unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
    key_name = table.get("signing_key")
    if not isinstance(key_name, str) or not key_name:
        raise where.error("[token] signing_key (an Ed25519 private key file) is required",
                          "token")
    signing = _private_key(path.parent / key_name, where)
    verify = [signing.public_key()]
    for name in _string_list(table.get("verify_keys", []), "verify_keys", where, "verify_keys"):
        verify.append(_public_key(path.parent / name, where))
    lifetime = table.get("lifetime", DEFAULT_LIFETIME)
    if not isinstance(lifetime, int) or isinstance(lifetime, bool) or not 10 <= lifetime <= 86400:
        raise where.error("lifetime must be a whole number of seconds, 10 to 86400", "lifetime")
    service, realm = table.get("service", DEFAULT_SERVICE), table.get("realm", "")
    if not isinstance(service, str) or not service or '"' in service:
        raise where.error("service must be a non-empty string without quotes", "service")
    if not isinstance(realm, str) or '"' in realm:
        raise where.error("realm must be a URL", "realm")
    by_key = {key: user.name for user in users.values() for key in user.keys}
    return AuthConfig(path, users, rules, signing, verify, lifetime, service, realm, by_key)


def _private_key(path: Path, where: _Locator) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise where.error(f"signing_key {path}: {exc}", "signing_key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise where.error(f"signing_key {path} is not an Ed25519 private key", "signing_key")
    return key


def _public_key(path: Path, where: _Locator) -> Ed25519PublicKey:
    """A PEM public key, or the public half of a PEM private key (the retired signing key)."""
    try:
        pem = path.read_bytes()
        key = (serialization.load_pem_private_key(pem, password=None).public_key()
               if b"PRIVATE KEY" in pem else serialization.load_pem_public_key(pem))
    except (OSError, ValueError, TypeError) as exc:
        raise where.error(f"verify key {path}: {exc}", path.name) from None
    if not isinstance(key, Ed25519PublicKey):
        raise where.error(f"verify key {path} is not an Ed25519 public key", path.name)
    return key
