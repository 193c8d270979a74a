"""ferry's own client against ferry's authenticated registry: Ollama-style key signatures and
`ferry login` credentials, through the real token endpoint (no fake auth layer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from registry.errors import FerryError
from registry.store import Store
from registry.transfer.auth import load_or_create_key
from registry.transfer.errors import AuthFailed
from registry.transfer.login import login
from registry.transfer.pull import pull
from registry.transfer.push import push
from tests.registry.service.auth_fixtures import serve_auth_registry, write_auth_file

from .helpers import fast_options, make_model, store_files


def public_key_line(home: Path) -> str:
    load_or_create_key(home / "id_ed25519")
    return (home / "id_ed25519.pub").read_text().strip()


async def test_a_registered_key_pushes_and_pulls_and_an_unknown_key_is_anonymous(
        tmp_path: Path, source: Store, target: Store) -> None:
    alice_home, stranger_home = tmp_path / "alice", tmp_path / "stranger"
    auth_file = write_auth_file(tmp_path, keys={"alice": public_key_line(alice_home)})
    with serve_auth_registry(tmp_path, auth_file) as url:
        host = url.removeprefix("http://")
        for repo in ("team/model", "public/model"):
            name = f"{host}/{repo}:v1"
            make_model(source, name, [3000, 200])
            await push(name, source, fast_options(alice_home, insecure=True), lambda e: None)
        await pull(f"{host}/public/model:v1", target,
                   fast_options(stranger_home, insecure=True), lambda e: None)
        assert any("public/model/v1" in f for f in store_files(target))
        with pytest.raises(FerryError, match="unauthorized"):
            await pull(f"{host}/team/model:v1", target,
                       fast_options(stranger_home, insecure=True), lambda e: None)
        make_model(source, f"{host}/public/mine:v1", [100], seed=3)
        with pytest.raises(FerryError, match="unauthorized"):
            await push(f"{host}/public/mine:v1", source,
                       fast_options(stranger_home, insecure=True), lambda e: None)
    assert not any("team" in f for f in store_files(target))


async def test_login_verifies_against_the_token_endpoint_and_saves_only_on_success(
        tmp_path: Path, source: Store) -> None:
    auth_file = write_auth_file(tmp_path)
    home = tmp_path / "home"
    with serve_auth_registry(tmp_path, auth_file) as url:
        host = url.removeprefix("http://")
        with pytest.raises(AuthFailed, match="refused the credentials"):
            await login(host, "alice", "wrong", home=home, insecure=True)
        with pytest.raises(AuthFailed):
            await login(host, "nobody", "alice-pw", home=home, insecure=True)
        assert not (home / "credentials.json").exists()
        await login(host, "alice", "alice-pw", home=home, insecure=True)
        assert "alice" in (home / "credentials.json").read_text()
        make_model(source, f"{host}/team/app:v1", [500])
        await push(f"{host}/team/app:v1", source, fast_options(home, insecure=True),
                   lambda e: None)
    assert not (home / "id_ed25519").exists()  # the saved password answered every challenge


def test_ferry_login_and_logout_cli_against_an_authenticated_and_an_open_registry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from conftest import serve_app

    from ferry.cli import main
    from registry.service.app import build_registry_app

    home = tmp_path / "home"
    monkeypatch.setenv("FERRY_HOME", str(home))
    creds = home / "credentials.json"

    def login_cli(host: str, password: str) -> int:
        monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
        return main(["login", "--insecure", "-u", "alice", "--password-stdin", host])

    with serve_auth_registry(tmp_path, write_auth_file(tmp_path)) as url:
        host = url.removeprefix("http://")
        assert login_cli(host, "wrong") == 1
        out = capsys.readouterr()
        assert "Login Succeeded" not in out.out and "refused the credentials" in out.err
        assert not creds.exists()
        assert login_cli(host, "alice-pw") == 0
        assert "Login Succeeded" in capsys.readouterr().out
        assert host in creds.read_text()
    assert main(["logout", host]) == 0
    assert "Removing login credentials" in capsys.readouterr().out
    assert host not in creds.read_text()
    assert main(["logout", host]) == 0
    assert "Not logged in" in capsys.readouterr().out
    with serve_app(build_registry_app(tmp_path / "open")) as url:
        assert login_cli(url.removeprefix("http://"), "anything") == 1
        assert "cannot check them; nothing was saved" in capsys.readouterr().err
    assert "alice" not in creds.read_text()
