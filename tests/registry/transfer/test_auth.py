"""Auth: the Bearer challenge answered with an Ed25519 signature or Basic credentials, the realm
host check, the key file's permissions, and the retry policy's classification."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

from registry.service.app import build_registry_app
from registry.store import Store
from registry.transfer.auth import load_or_create_key, parse_challenge
from registry.transfer.errors import AuthFailed, TransientStatus
from registry.transfer.login import login
from registry.transfer.pull import pull
from registry.transfer.push import push
from registry.transfer.retry import RetryPolicy

from .fakes import RequestLog, TokenAuth, hops_app
from .helpers import fast_options, make_model


def test_challenge_parsing_accepts_quoted_and_bare_values() -> None:
    challenge = parse_challenge('Bearer realm="https://r.example/token",service=reg,'
                                'scope="repository:ns/m:pull repository:ns/n:pull"')
    assert challenge.scheme == "bearer"
    assert challenge.params == {"realm": "https://r.example/token", "service": "reg",
                                "scope": "repository:ns/m:pull repository:ns/n:pull"}


async def test_key_signed_token_request_and_bearer_only_to_the_registry(
        tmp_path: Path, source: Store, target: Store) -> None:
    auth = TokenAuth(build_registry_app(tmp_path / "registry"), realm="")
    log = RequestLog(auth)
    home = tmp_path / "home"
    with serve_app(log) as url:
        auth.realm = f"{url}/token"
        name = f"{url.removeprefix('http://')}/ns/model:v1"
        make_model(source, name, [5000])
        await push(name, source, fast_options(home, insecure=True), lambda e: None)
        await pull(name, target, fast_options(home, insecure=True), lambda e: None)
    key = home / "id_ed25519"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    pub = (home / "id_ed25519.pub").read_text().split()[1]
    assert auth.token_requests
    first = auth.token_requests[0]
    assert first["authorization"].startswith(pub + ":")  # signed with the user's key
    assert set(first["query"]) == {"service", "scope", "ts", "nonce"}
    assert "Bearer token-for-tests" in log.authorizations


async def test_a_realm_on_another_host_is_refused_and_never_contacted(
        tmp_path: Path, source: Store) -> None:
    elsewhere, hits = hops_app()
    with serve_app(elsewhere, host="127.0.0.2") as other:
        auth = TokenAuth(build_registry_app(tmp_path / "registry"), realm=f"{other}/ok")
        with serve_app(auth) as url:
            name = f"{url.removeprefix('http://')}/ns/model:v1"
            make_model(source, name, [100])
            with pytest.raises(AuthFailed, match="does not match original host"):
                await push(name, source, fast_options(tmp_path / "h", insecure=True),
                           lambda e: None)
    assert sum(hits.values()) == 0
    assert not (tmp_path / "h" / "id_ed25519").exists()  # nothing was signed either


async def test_login_checks_the_password_then_pulls_use_basic_for_the_token(
        tmp_path: Path, source: Store, target: Store) -> None:
    auth = TokenAuth(build_registry_app(tmp_path / "registry"), realm="",
                     password=("alice", "s3cret"))
    home = tmp_path / "home"
    with serve_app(auth) as url:
        auth.realm = f"{url}/token"
        host = url.removeprefix("http://")
        with pytest.raises(AuthFailed):
            await login(host, "alice", "wrong", home=home, insecure=True)
        assert not (home / "credentials.json").exists()
        await login(host, "alice", "s3cret", home=home, insecure=True)
        creds = home / "credentials.json"
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
        name = f"{host}/ns/model:v1"
        make_model(source, name, [100])
        await push(name, source, fast_options(home, insecure=True), lambda e: None)
    assert auth.token_requests[-1]["authorization"].startswith("Basic ")
    assert not (home / "id_ed25519").exists()  # a password was there: no key needed


def test_a_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    load_or_create_key(key)
    key.chmod(0o644)
    with pytest.raises(AuthFailed, match="too open"):
        load_or_create_key(key)


async def test_retry_after_is_honoured_and_client_errors_fail_at_once() -> None:
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    policy = RetryPolicy(attempts=4, initial=0.01, cap=0.02, sleep=record)
    calls = 0

    async def throttled(attempt: int) -> str:
        nonlocal calls
        calls += 1
        if attempt < 3:
            raise TransientStatus(429, "slow down", retry_after=7.0)
        return "done"

    assert await policy.run("x", throttled) == "done"
    assert waits == [7.0, 7.0] and calls == 3

    async def refused(attempt: int) -> None:
        nonlocal calls
        calls += 1
        raise httpx.InvalidURL("bad") if attempt else None

    calls = 0
    with pytest.raises(httpx.InvalidURL):
        await policy.run("x", refused)
    assert calls == 1


def test_ferry_login_cli_saves_credentials_only_when_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from ferry.cli import main

    auth = TokenAuth(build_registry_app(tmp_path / "registry"), realm="",
                     password=("alice", "s3cret"))
    home = tmp_path / "home"
    monkeypatch.setenv("FERRY_HOME", str(home))
    with serve_app(auth) as url:
        auth.realm = f"{url}/token"
        host = url.removeprefix("http://")
        monkeypatch.setattr("sys.stdin", io.StringIO("nope\n"))
        assert main(["login", "--insecure", "-u", "alice", "--password-stdin", host]) == 1
        assert "unauthorized" in capsys.readouterr().err
        assert not (home / "credentials.json").exists()
        monkeypatch.setattr("sys.stdin", io.StringIO("s3cret\n"))
        assert main(["login", "--insecure", "-u", "alice", "--password-stdin", host]) == 0
    saved = (home / "credentials.json").read_text()
    assert '"alice"' in saved and host in saved
