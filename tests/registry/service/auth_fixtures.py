"""An authenticated registry for tests: an auth file written by `add_user`, served on loopback."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
from conftest import serve_app

from registry.service.app import build_registry_app
from registry.service.auth.audit import AuditLog
from registry.service.auth.config import load_auth_config
from registry.service.auth.limits import LimitSettings
from registry.service.auth.userfile import add_user

RULES = """
[access."team/*"]
alice = ["pull", "push", "delete"]
readers = ["pull"]

[access."public/*"]
anonymous = ["pull"]
alice = ["pull", "push"]
"""


def write_auth_file(root: Path, keys: dict[str, str] | None = None) -> Path:
    """alice: push/pull/delete on team/*; bob (group readers): pull on team/*; public/* is
    anonymous pull. `keys` registers an ssh-ed25519 public key per user name."""
    path = root / "auth" / "registry-auth.toml"
    keys = keys or {}
    add_user(path, "alice", "alice-pw", [keys["alice"]] if "alice" in keys else [], [])
    add_user(path, "bob", "bob-pw", [keys["bob"]] if "bob" in keys else [], ["readers"])
    path.write_text(path.read_text() + RULES)
    return path


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def serve_auth_registry(root: Path, auth_file: Path, limits: LimitSettings | None = None,
                        audit: Path | None = None, store=None) -> Iterator[str]:
    app = build_registry_app(root / "registry", store=store, auth=load_auth_config(auth_file),
                             limits=limits, audit=AuditLog(str(audit)) if audit else None)
    return serve_app(app)


def get_token(url: str, authorization: str | None, *scopes: str) -> str:
    headers = {"Authorization": authorization} if authorization else {}
    r = httpx.get(f"{url}/token", params=[("service", "ferry-registry"),
                                          *[("scope", s) for s in scopes]], headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token"] == body["access_token"] and body["expires_in"] == 300
    return body["token"]


def read_audit(path: Path) -> list[dict]:
    """The audit log's records, once the server's delayed flush has written them."""
    import json
    import time

    from registry.service.auth.audit import FLUSH_DELAY

    time.sleep(FLUSH_DELAY * 3)
    return [json.loads(line) for line in path.read_text().splitlines()]
