"""The auth file: `ferry registry user add` writes it, a bad one stops start-up with file, line
and reason, and an open registry refuses a non-loopback address."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ferry.cli import main
from registry.service.auth.config import AuthConfigError, load_auth_config
from registry.service.auth.passwords import check_password

from .auth_fixtures import write_auth_file

PUBKEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMWAVMRxBNVFSGbh7hEVqdNnDmLVs7kyR+RFAM8hl5C4 "
          "alice@laptop")


def add(monkeypatch: pytest.MonkeyPatch, password: str, *argv: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(password + "\n"))
    return main(["registry", "user", "add", *argv])


def test_user_add_creates_the_file_and_key_and_stores_only_a_slow_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "conf" / "auth.toml"
    assert add(monkeypatch, "pw-alice", "--auth", str(path), "alice") == 0
    assert add(monkeypatch, "", "--auth", str(path), "bob", "--no-password", "--key", PUBKEY,
               "--group", "publishers") == 0
    assert (path.stat().st_mode & 0o777) == 0o600
    assert ((path.parent / "token-key.pem").stat().st_mode & 0o777) == 0o600
    assert "pw-alice" not in path.read_text()
    config = load_auth_config(path)
    assert check_password("pw-alice", config.users["alice"].password_hash)
    assert not check_password("pw-alicE", config.users["alice"].password_hash)
    bob = config.users["bob"]
    assert bob.groups == {"publishers"} and bob.password_hash is None
    assert config.by_key[PUBKEY.split()[1]] == "bob"
    assert add(monkeypatch, "x", "--auth", str(path), "alice") == 1
    assert "already exists" in capsys.readouterr().err
    assert add(monkeypatch, "x", "--auth", str(path), "carol", "--key", "ssh-rsa AAAA") == 1
    assert "ssh-ed25519" in capsys.readouterr().err
    assert "carol" not in path.read_text()  # a refused add leaves the file as it was


@pytest.mark.parametrize(("text", "line", "reason"), [
    ('[access."a/*"]\nalice = ["pull", "fly"]\n', 3, "unknown action 'fly'"),
    ('[access."a/*"]\nmallory = ["pull"]\n', 3, "'mallory' is no user"),
    ('[users.dave]\npassword = "plain-text"\n', 3, "scrypt$15$8$1"),
    ('[groups]\nops = "alice"\n', 3, "group 'ops' must be a list"),
    ("[token\n", 2, "not valid TOML"),
    ("[tokens]\n", 2, "unknown section [tokens]"),
])
def test_a_bad_auth_file_names_the_file_line_and_reason(
        tmp_path: Path, text: str, line: int, reason: str) -> None:
    path = write_auth_file(tmp_path)
    original = path.read_text()
    path.write_text(original + "\n" + text)
    expected_line = len(original.splitlines()) + line
    with pytest.raises(AuthConfigError) as caught:
        load_auth_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{expected_line}: "), message
    assert reason in message


def test_serve_refuses_a_bad_auth_file_and_an_open_registry_off_loopback(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[token]\nsigning_key = "missing.pem"\n')
    assert main(["registry", "serve", "--root", str(tmp_path / "r"), "--auth", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:2: signing_key" in err
    assert main(["registry", "serve", "--root", str(tmp_path / "r"), "--host", "0.0.0.0"]) == 1
    err = capsys.readouterr().err
    assert "refusing to serve an open registry on 0.0.0.0" in err
    assert "--allow-anonymous-writes" in err
