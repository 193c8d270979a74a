"""The official `ollama` Python client drives `ferry serve`, which pushes to and pulls from an
authenticated ferry registry with the server's Ed25519 key, registered for a user."""

from __future__ import annotations

from pathlib import Path

import ollama
import pytest

from registry.names import Name
from registry.store import Store
from registry.transfer.auth import load_or_create_key
from tests.registry.service.auth_fixtures import serve_auth_registry, write_auth_file
from tests.registry.transfer.helpers import make_model


def test_ollama_client_pushes_and_pulls_through_a_key_authenticated_registry(
        tmp_path: Path, settings, store: Store, model_server: str) -> None:
    load_or_create_key(settings.home / "id_ed25519")  # the key `ferry serve` signs with
    pub = (settings.home / "id_ed25519.pub").read_text().strip()
    client = ollama.Client(host=model_server)
    with serve_auth_registry(tmp_path, write_auth_file(tmp_path, keys={"alice": pub})) as url:
        host = url.removeprefix("http://")
        name = f"{host}/team/auth-model:v1"
        raw = make_model(store, name, [40_000, 3_000])
        assert client.push(name, insecure=True).status == "success"
        client.delete(name)
        assert client.pull(name, insecure=True).status == "success"
        assert store.read_manifest(Name.parse(name)) == raw
        with pytest.raises(ollama.ResponseError, match="unauthorized"):
            client.pull(f"{host}/elsewhere/model:v1", insecure=True)
