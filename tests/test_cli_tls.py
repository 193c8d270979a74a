"""TLS for both servers: `ferry serve` and `ferry registry serve` with --tls-cert/--tls-key (or
FERRY_TLS_CERT/FERRY_TLS_KEY), a trustme CA, and ferry's clients trusting it via SSL_CERT_FILE."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import REPO, free_port

from registry.store import Store
from registry.transfer.auth import load_or_create_key
from registry.transfer.pull import pull
from registry.transfer.push import push
from tests.registry.service.auth_fixtures import write_auth_file
from tests.registry.transfer.helpers import fast_options, make_model
from tests.registry.transfer.tls import test_ca as shared_ca


def write_cert(tmp_path: Path) -> tuple[str, str, str]:
    ca = shared_ca()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(files[0]))
    cert.private_key_pem.write_to_path(str(files[1]))
    ca.cert_pem.write_to_path(str(files[2]))
    return str(files[0]), str(files[1]), str(files[2])


@contextlib.contextmanager
def running(argv: list[str], probe: str, ca: str, env: dict[str, str]) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-m", "ferry.cli", *argv], cwd=REPO,
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                httpx.get(probe, verify=ssl.create_default_context(cafile=ca), timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_registry_serve_speaks_https_with_auth_and_the_client_trusts_the_ca(
        tmp_path: Path) -> None:
    cert, key, ca = write_cert(tmp_path)
    home = tmp_path / "home"
    load_or_create_key(home / "id_ed25519")
    pub = (home / "id_ed25519.pub").read_text().strip()
    auth_file = write_auth_file(tmp_path, keys={"alice": pub})
    port = free_port()
    argv = ["registry", "serve", "--port", str(port), "--root", str(tmp_path / "root"),
            "--auth", str(auth_file), "--tls-cert", cert, "--tls-key", key,
            "--audit-log", str(tmp_path / "audit.log")]
    with running(argv, f"https://127.0.0.1:{port}/v2/", ca, {}):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://127.0.0.1:{port}/v2/")  # not trusted without the CA
        r = httpx.get(f"https://127.0.0.1:{port}/v2/",
                      verify=ssl.create_default_context(cafile=ca))
        assert r.status_code == 401
        assert f'realm="https://127.0.0.1:{port}/token"' in r.headers["WWW-Authenticate"]
        source, target = Store(tmp_path / "source"), Store(tmp_path / "target")
        name = f"127.0.0.1:{port}/team/tls:v1"
        make_model(source, name, [20_000])
        options = fast_options(home, ca_file=ca)
        asyncio.run(push(name, source, options, lambda e: None))
        asyncio.run(pull(name, target, options, lambda e: None))
    assert '"subject":"alice"' in (tmp_path / "audit.log").read_text()


def test_model_server_speaks_https_from_the_environment_and_the_cli_trusts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        make_checkpoint) -> None:
    from ferry.cli import main

    cert, key, ca = write_cert(tmp_path)
    port = free_port()
    env = {"FERRY_HOME": str(tmp_path / "home"), "FERRY_HOST": f"127.0.0.1:{port}",
           "FERRY_TLS_CERT": cert, "FERRY_TLS_KEY": key}
    with running(["serve"], f"https://127.0.0.1:{port}/api/version", ca, env):
        monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("FERRY_HOST", f"https://127.0.0.1:{port}")
        monkeypatch.setenv("SSL_CERT_FILE", ca)
        assert main(["list"]) == 0
        # create streams the weights over its own connections: they trust the CA too
        (tmp_path / "Modelfile").write_text(f"FROM {make_checkpoint('llama')}\n")
        assert main(["create", "me/tls", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 0
        assert main(["show", "me/tls"]) == 0
        capsys.readouterr()
        monkeypatch.delenv("SSL_CERT_FILE")
        assert main(["list"]) == 1
        assert "point SSL_CERT_FILE at its CA bundle" in capsys.readouterr().err
        assert main(["create", "me/tls2", "-f", str(tmp_path / "Modelfile")]) == 1
        assert "SSL_CERT_FILE" in capsys.readouterr().err


def test_tls_needs_both_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from ferry.cli import main

    cert, _, _ = write_cert(tmp_path)
    assert main(["registry", "serve", "--root", str(tmp_path), "--tls-cert", cert]) == 1
    assert "both a certificate and its key" in capsys.readouterr().err


def test_cli_clients_share_one_trust_context_per_ca_file(tmp_path: Path) -> None:
    """Loading a CA bundle costs tens of ms: `ferry create` builds it once for its clients."""
    from ferry.client import server_verify
    from ferry.config import Settings

    ca_file = tmp_path / "ca.pem"
    shared_ca().cert_pem.write_to_path(str(ca_file))
    plain = Settings.from_env({"FERRY_HOME": str(tmp_path)})
    private = Settings.from_env({"FERRY_HOME": str(tmp_path), "SSL_CERT_FILE": str(ca_file)})
    assert isinstance(server_verify(plain), ssl.SSLContext)
    assert server_verify(plain) is server_verify(plain)
    assert server_verify(private) is server_verify(private)
    assert server_verify(private) is not server_verify(plain)
    assert server_verify(private).get_ca_certs() != server_verify(plain).get_ca_certs()
