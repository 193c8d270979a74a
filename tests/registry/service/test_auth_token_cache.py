"""The verified-token cache: it saves the signature check on repeat requests and nothing else.

A token the cache has seen must still be refused once it expires or once its signing key is no
longer trusted, a variant of it must get the full check, and the cache stays bounded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry.service.auth import tokens as tokens_module
from registry.service.auth.config import load_auth_config
from registry.service.auth.gate import Gate
from registry.service.auth.scopes import Scope, covers
from registry.service.auth.tokens import ISSUER, Claims, Tokens, key_id

from .auth_fixtures import serve_auth_registry, write_auth_file

ACCESS = [{"type": "repository", "name": "team/app", "actions": ["pull"]}]


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    return write_auth_file(tmp_path)


def signing_key(auth_file: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(
        (auth_file.parent / "token-key.pem").read_bytes(), password=None)
    assert isinstance(key, Ed25519PrivateKey)
    return key


def forge(key: Ed25519PrivateKey, expires: int, **changes: Any) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "sub": "alice", "aud": "ferry-registry", "iat": now,
              "exp": expires, "access": ACCESS, **changes}
    return jwt.encode(claims, key, algorithm="EdDSA", headers={"kid": key_id(key.public_key())})


def wait_past(expires: int) -> None:
    while time.time() <= expires + 0.05:
        time.sleep(0.05)


def test_a_cached_token_is_refused_once_it_expires(auth_file: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "LEEWAY", 0)  # else expiry waits out 10 s of skew
    with serve_auth_registry(tmp_path, auth_file) as url:
        expires = int(time.time()) + 3  # seconds enough for the requests below on a busy box
        token = forge(signing_key(auth_file), expires)
        target = f"{url}/v2/team/app/tags/list"
        headers = {"Authorization": f"Bearer {token}"}
        for _ in range(2):  # the first request verifies and caches it, the second hits the cache
            assert httpx.get(target, headers=headers).status_code == 404  # let in: no such repo
        wait_past(expires)
        r = httpx.get(target, headers=headers)
        assert r.status_code == 401
        assert 'error="insufficient_scope"' in r.headers["WWW-Authenticate"]


def test_a_cached_token_is_refused_once_its_key_is_no_longer_trusted(auth_file: Path) -> None:
    tokens = Gate(load_auth_config(auth_file)).tokens
    token = tokens.issue("alice", [Scope("repository", "team/app", frozenset({"pull"}))]).token
    assert tokens.verify(token) is not None and tokens.verify(token) is not None  # cached
    tokens.keys = {}  # the key retired while the process runs
    assert tokens.verify(token) is None
    assert token not in tokens._cache  # forgotten, not kept for a later hit


def test_expired_entries_are_dropped_and_variants_of_a_cached_token_get_the_full_check(
        auth_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "LEEWAY", 0)
    config = load_auth_config(auth_file)
    tokens = Tokens(config.signing_key, config.verify_keys, config.service, config.lifetime)
    expires = int(time.time()) + 1
    token = forge(config.signing_key, expires)
    claims = tokens.verify(token)
    assert claims is not None and claims.allows("team/app", "pull")
    header, payload, signature = token.split(".")
    widened = jwt.utils.base64url_encode(jwt.utils.base64url_decode(payload).replace(
        b'"pull"', b'"push"')).decode()
    assert tokens.verify(".".join([header, widened, signature])) is None  # tampered
    assert tokens.verify(token + " ") is None and tokens.verify(token[:-2]) is None
    wait_past(expires)
    assert tokens.verify(token) is None
    assert token not in tokens._cache


def test_the_cache_is_bounded_and_forgets_the_oldest_first(
        auth_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "CACHE_LIMIT", 3)
    tokens = Gate(load_auth_config(auth_file)).tokens
    issued = [tokens.issue(f"user{i}", []).token for i in range(5)]
    for token in issued:
        assert tokens.verify(token) is not None
    assert list(tokens._cache) == issued[2:]
    claims = tokens.verify(issued[0])  # forgotten, so verified again in full: still good
    assert claims is not None and claims.subject == "user0"
    assert list(tokens._cache) == [*issued[3:], issued[0]]


@pytest.mark.parametrize("access", [
    ACCESS,
    [{"type": "repository", "name": "team/app", "actions": ["pull"]},
     {"type": "repository", "name": "team/app", "actions": ["push", "delete"]}],
    [{"type": "registry", "name": "team/app", "actions": ["pull"]}],
    [{"type": "repository", "name": "team/app", "actions": "pull"}],
    [{"type": "repository", "name": ["team/app"], "actions": ["pull"]}],
    [{"type": "repository", "name": "team/app", "actions": [["pull"], 7, "push"]}],
    ["repository:team/app:pull", 3, None],
    [],
])
def test_claims_allows_agrees_with_the_access_claim(access: list[Any]) -> None:
    claims = Claims("alice", access, time.time() + 60)
    for repo in ("team/app", "team/other", ""):
        for action in ("pull", "push", "delete", "*"):
            assert claims.allows(repo, action) == covers(access, repo, action), (repo, action)


def test_a_header_is_remembered_by_its_bytes_and_grants_no_more_than_its_token(
        auth_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "LEEWAY", 0)
    config = load_auth_config(auth_file)
    tokens = Tokens(config.signing_key, config.verify_keys, config.service, config.lifetime)
    expires = int(time.time()) + 1
    token = forge(config.signing_key, expires)
    header = f"Bearer {token}".encode()
    for _ in range(2):  # verified, then a hit on the very bytes
        claims = tokens.verify_bearer(header)
        assert claims is not None and claims.allows("team/app", "pull")
        assert not claims.allows("team/app", "push")
    assert header in tokens._cache
    for variant in (f"bearer {token}", f"Bearer  {token} ", f"BEARER {token}".ljust(4000)):
        assert tokens.verify_bearer(variant.encode()) is not None
        assert variant.encode() not in tokens._cache  # remembered by its token, not its bytes
    assert token in tokens._cache
    header_, payload, signature = token.split(".")
    widened = jwt.utils.base64url_encode(jwt.utils.base64url_decode(payload).replace(
        b'"pull"', b'"push"')).decode()
    too_long = f"Bearer {token}".ljust(tokens_module.MAX_AUTHORIZATION + 1).encode()
    for refused in (f"Bearer {header_}.{widened}.{signature}".encode(), f"Basic {token}".encode(),
                    token.encode(), too_long, f"Bearer {token[:-2]}".encode()):
        assert tokens.verify_bearer(refused) is None
        assert refused not in tokens._cache  # refusals are never remembered
    wait_past(expires)
    assert tokens.verify_bearer(header) is None  # a remembered header expires with its token
    assert header not in tokens._cache
    tokens = Tokens(config.signing_key, config.verify_keys, config.service, config.lifetime)
    fresh = tokens.issue("alice", [Scope("repository", "team/app", frozenset({"pull"}))]).token
    assert tokens.verify_bearer(f"Bearer {fresh}".encode()) is not None
    tokens.keys = {}  # its key retired while the process runs
    assert tokens.verify_bearer(f"Bearer {fresh}".encode()) is None
