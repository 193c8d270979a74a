"""End to end: a model placed in the model server's store is pushed to ferry's registry on
127.0.0.1 with --insecure, deleted locally, and pulled back byte-identical, through
`POST /api/push` / `POST /api/pull` and through the `ferry push` / `ferry pull` CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from ferry.cli import main
from registry.manifests import parse_manifest
from registry.names import Name
from registry.store import Store
from server.transfer_api import transfer_options
from tests.registry.transfer.conftest import registry_host  # noqa: F401 (a fixture)
from tests.registry.transfer.helpers import make_model, store_files


def _ndjson(response: httpx.Response) -> list[dict]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def _snapshot(store: Store, raw: bytes) -> dict[str, bytes]:
    return {str(d.digest): store.read_blob(d.digest)
            for d in parse_manifest(raw).references()}


def test_push_delete_pull_through_the_api_is_byte_identical(
        model_server: str, store: Store, registry_host: str) -> None:
    name = f"{registry_host}/ns/model:v1"
    raw = make_model(store, name, [300_000, 5_000])
    blobs = _snapshot(store, raw)
    with httpx.Client(base_url=model_server, timeout=60) as http:
        pushed = _ndjson(http.post("/api/push", json={"model": name, "insecure": True}))
        statuses = [e["status"] for e in pushed]
        assert statuses[0] == "retrieving manifest"
        assert statuses[-2:] == ["pushing manifest", "success"]
        layer = [e for e in pushed if e.get("digest") == str(parse_manifest(raw).layers[0].digest)]
        assert layer[-1]["completed"] == layer[-1]["total"] == 300_000

        store.delete_model(Name.parse(name))
        assert not any(f.startswith("blobs/sha256-") for f in store_files(store))

        pulled = _ndjson(http.post("/api/pull", json={"model": name, "insecure": True}))
        statuses = [e["status"] for e in pulled]
        assert statuses[0] == "pulling manifest"
        assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
        assert any(s.startswith("pulling ") and s != "pulling manifest" for s in statuses)

        store.delete_model(Name.parse(name))
        quiet = http.post("/api/pull", json={"model": name, "insecure": True, "stream": False})
        assert quiet.status_code == 200 and quiet.json() == {"status": "success"}
    assert store.read_manifest(Name.parse(name)) == raw
    assert _snapshot(store, raw) == blobs


def test_api_errors_follow_the_streaming_conventions(model_server: str,
                                                      registry_host: str) -> None:
    with httpx.Client(base_url=model_server, timeout=60) as http:
        missing = http.post("/api/push", json={})
        assert missing.status_code == 400 and missing.json() == {"error": "model is required"}
        plain = http.post("/api/pull", json={"model": f"http://{registry_host}/ns/m:v1"})
        assert plain.status_code == 400
        assert "insecure protocol http" in plain.json()["error"]
        name = f"{registry_host}/ns/absent:v1"
        streamed = http.post("/api/pull", json={"model": name, "insecure": True})
        assert streamed.status_code == 200
        lines = _ndjson(streamed)
        assert lines[0] == {"status": "pulling manifest"}
        assert lines[-1] == {"error": "pull model manifest: file does not exist"}
        quiet = http.post("/api/pull", json={"model": name, "insecure": True, "stream": False})
        assert quiet.status_code == 404
        assert quiet.json() == {"error": "pull model manifest: file does not exist"}


def test_cli_push_and_pull_round_trip_and_failure_exit_status(
        model_server: str, store: Store, registry_host: str, settings,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FERRY_HOST", model_server)
    monkeypatch.setenv("FERRY_HOME", str(settings.home))
    name = f"{registry_host}/ns/cli:v1"
    raw = make_model(store, name, [70_000])
    assert main(["push", "--insecure", name]) == 0
    store.delete_model(Name.parse(name))
    assert main(["pull", "--insecure", name]) == 0
    assert store.read_manifest(Name.parse(name)) == raw
    capsys.readouterr()
    assert main(["pull", "--insecure", f"{registry_host}/ns/absent:v1"]) == 1
    assert "Error: pull model manifest: file does not exist" in capsys.readouterr().err
    # Without --insecure the registry is spoken to over https, which it does not speak: a clear
    # error at once, not six retries of a TLS handshake.
    assert main(["pull", name]) == 1
    assert "does not speak https; pass --insecure" in capsys.readouterr().err


def test_https_registry_with_a_private_ca(tmp_path: Path, store: Store) -> None:
    """No --insecure: https to the user-named registry, trusted through SSL_CERT_FILE."""
    import asyncio

    from registry.service.app import build_registry_app
    from registry.transfer.pull import pull
    from registry.transfer.push import push
    from tests.registry.transfer.helpers import fast_options
    from tests.registry.transfer.tls import tls_server

    target = Store(tmp_path / "target")
    with tls_server(build_registry_app(tmp_path / "reg"), "127.0.0.1", tmp_path) as (url, ca):
        name = f"{url.removeprefix('https://')}/ns/tls:v1"
        raw = make_model(store, name, [20_000])
        asyncio.run(push(name, store, fast_options(tmp_path / "h", ca_file=ca), lambda e: None))
        asyncio.run(pull(name, target, fast_options(tmp_path / "h", ca_file=ca), lambda e: None))
        from registry.transfer.pull import ManifestError

        # Without the CA the certificate is not trusted, and that is not retried.
        with pytest.raises(ManifestError, match="CERTIFICATE_VERIFY_FAILED") as err:
            asyncio.run(pull(name, Store(tmp_path / "t2"), fast_options(tmp_path / "h"),
                             lambda e: None))
        assert "attempts" not in str(err.value)
    assert target.read_manifest(Name.parse(name)) == raw


def test_a_client_disconnect_stops_the_pull_and_keeps_its_partial_blob(
        tmp_path: Path, settings, store: Store) -> None:
    import time

    from conftest import serve_app

    from ferry.app import build_model_server
    from tests.registry.transfer.conftest import registry_with_cdn
    from tests.registry.transfer.helpers import fast_options

    source = Store(tmp_path / "source")
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        make_model(source, name, [4 * 1024 * 1024])
        import asyncio

        from registry.transfer.push import push

        asyncio.run(push(name, source, fast_options(tmp_path / "p", insecure=True),
                         lambda e: None))
        fast = fast_options(settings.home)
        small_parts = dataclasses.replace(transfer_options(settings), **{
            k: getattr(fast, k)
            for k in ("part_min", "part_max", "checkpoint_bytes", "retry", "small_blob_max")})
        app = build_model_server(settings, transfer=small_parts)
        cdn.delay = 0.05
        with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/api/pull", json={"model": name, "insecure": True}) as r:
                for line in r.iter_lines():
                    event = json.loads(line)
                    if event.get("completed") and event.get("total", 0) > 1_000_000:
                        break  # leave mid-blob: the connection closes here
            time.sleep(0.5)
            served = cdn.bytes_served
            time.sleep(0.5)
            assert cdn.bytes_served == served  # the pull stopped with its client
    assert served < 4 * 1024 * 1024
    assert not store.manifest_path(Name.parse(name)).exists()
    assert any("-partial" in f for f in store_files(store))  # kept for the next attempt


def test_ssl_cert_file_lets_the_model_server_trust_a_private_registry(tmp_path: Path) -> None:
    from conftest import serve_app

    from ferry.app import build_model_server
    from ferry.config import Settings
    from registry.service.app import build_registry_app
    from tests.registry.transfer.tls import tls_server

    with tls_server(build_registry_app(tmp_path / "reg"), "127.0.0.1", tmp_path) as (reg, ca):
        settings = Settings.from_env({"FERRY_HOME": str(tmp_path / "home"), "SSL_CERT_FILE": ca})
        store = Store(settings.models_dir)
        name = f"{reg.removeprefix('https://')}/ns/private:v1"
        raw = make_model(store, name, [10_000])
        with serve_app(build_model_server(settings)) as url, \
                httpx.Client(base_url=url, timeout=60) as http:
            pushed = http.post("/api/push", json={"model": name, "stream": False})
            assert pushed.json() == {"status": "success"}
            store.delete_model(Name.parse(name))
            pulled = http.post("/api/pull", json={"model": name, "stream": False})
            assert pulled.json() == {"status": "success"}
    assert store.read_manifest(Name.parse(name)) == raw


def test_the_official_ollama_client_pushes_and_pulls_through_ferry(
        model_server: str, store: Store, registry_host: str) -> None:
    import ollama

    name = f"{registry_host}/ns/interop:v1"
    raw = make_model(store, name, [50_000])
    client = ollama.Client(host=model_server)
    statuses = [p.status for p in client.push(name, insecure=True, stream=True)]
    assert statuses[0] == "retrieving manifest" and statuses[-1] == "success"
    store.delete_model(Name.parse(name))
    last = client.pull(name, insecure=True, stream=False)
    assert last.status == "success"
    assert store.read_manifest(Name.parse(name)) == raw
    with pytest.raises(ollama.ResponseError, match="file does not exist"):
        client.pull(f"{registry_host}/ns/absent:v1", insecure=True, stream=False)


def test_the_server_builds_its_transfer_options_from_settings(tmp_path: Path) -> None:
    from ferry.app import build_model_server
    from ferry.config import Settings

    settings = Settings.from_env({
        "FERRY_HOME": str(tmp_path), "FERRY_MAX_TRANSFER_STREAMS": "3", "FERRY_NOPRUNE": "1",
        "FERRY_REGISTRY_MAX_MANIFEST_BYTES": "65536", "SSL_CERT_FILE": "/etc/ca.pem"})
    options = build_model_server(settings).state.transfer_options
    assert (options.home, options.max_streams, options.noprune) == (tmp_path, 3, True)
    assert (options.max_manifest_bytes, options.ca_file) == (65536, "/etc/ca.pem")
    assert options.insecure is False
