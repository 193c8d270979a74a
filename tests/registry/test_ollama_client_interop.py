"""The official `ollama` Python client against a real `ferry serve` and an Ollama-written store."""

from __future__ import annotations

import hashlib
import json

import ollama
import pytest
from fixtures_ollama import OllamaModelsDir


@pytest.fixture
def client(model_server) -> ollama.Client:
    return ollama.Client(host=model_server)


def test_ollama_client_lists_shows_copies_and_deletes(client, settings):
    models_dir = OllamaModelsDir(settings.models_dir)
    raw = models_dir.gguf_model("tiny:latest", params={"temperature": 0.2}, system="Hi.")

    (listed,) = client.list().models
    assert listed.model == "tiny:latest"
    assert listed.digest == hashlib.sha256(raw).hexdigest()
    manifest = json.loads(raw)
    assert listed.size == manifest["config"]["size"] + sum(x["size"] for x in manifest["layers"])
    assert listed.details is not None and listed.details.family == "llama"
    assert listed.modified_at is not None

    shown = client.show("tiny")
    assert shown.license == "MIT License"
    assert shown.details is not None and shown.details.quantization_level == "Q4_0"
    assert shown.modelinfo == {}
    assert shown.capabilities == ["completion"]
    assert shown.parameters is not None and "temperature" in shown.parameters
    assert shown.modelfile is not None and "SYSTEM Hi." in shown.modelfile

    assert client.copy("tiny", "me/tiny-copy:v2").status == "success"
    assert {m.model for m in client.list().models} == {"tiny:latest", "me/tiny-copy:v2"}

    assert client.delete("tiny").status == "success"
    assert [m.model for m in client.list().models] == ["me/tiny-copy:v2"]
    # The copy shares every blob, so deleting the original removed none of them.
    assert client.show("me/tiny-copy:v2").license == "MIT License"


def test_ollama_client_sees_ferry_errors_as_response_errors(client):
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("absent")
    assert missing.value.status_code == 404
    assert missing.value.error == "model 'absent' not found"
    with pytest.raises(ollama.ResponseError) as bad:
        client.copy("../escape", "x")
    assert bad.value.status_code == 400
    assert 'source "../escape" is invalid' in bad.value.error


def test_ollama_client_uploads_a_blob(client, settings, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00GGUF-ish" * 1000)
    digest = client.create_blob(path)
    stored = settings.models_dir / "blobs" / digest.replace(":", "-")
    assert stored.read_bytes() == path.read_bytes()
    assert client.create_blob(path) == digest  # second time: 200, already present
