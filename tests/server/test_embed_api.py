"""Embeddings end to end: `ferry create` of a BERT checkpoint, then /api/embed, /api/embeddings
and /v1/embeddings through the official `ollama` and `openai` clients and the real runner.

One model server serves the module; the embedding model is created with the CLI (so its
sentence-transformers 1_Pooling/config.json must travel with it: the fixture asks for mean
pooling, BERT's default is CLS, and the vectors are checked against the mean-pooled numpy
reference), and a tiny llama is created beside it for the capability refusals.
"""

from __future__ import annotations

import base64
import os
import struct
import threading
import time
from unittest import mock

import httpx
import numpy as np
import ollama
import openai
import pytest
from conftest import serve_app

from tests.runner.embedding_checkpoints import reference_embedding, write_checkpoint

TEXTS = ["the quick brown fox", "hello world", "ferry boat on the river"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_checkpoint):
    from ferry.app import build_model_server
    from ferry.cli import main
    from ferry.config import Settings
    from registry.names import Name
    from registry.store import Store
    from workflows.create import CreateOptions, create

    home = tmp_path_factory.mktemp("home")
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("bert"), "bert", pooling="mean")
    settings = Settings.from_env({"FERRY_HOME": str(home)})
    store = Store(settings.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse_valid("me/tiny"), make_checkpoint("llama", "tiny"), CreateOptions(),
           store, progress=lambda event: None, cancel=threading.Event())
    with serve_app(build_model_server(settings)) as url:
        modelfile = checkpoint.parent / "Modelfile"
        modelfile.write_text(f"FROM {checkpoint}\n")
        with mock.patch.dict(os.environ, {"FERRY_HOST": url, "FERRY_HOME": str(home)}):
            assert main(["create", "me/embed", "-f", str(modelfile)]) == 0
        yield url, checkpoint


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served[0], timeout=120)


def _reference(checkpoint, text: str) -> np.ndarray:
    return reference_embedding(checkpoint, "bert", text, "mean")


def test_ollama_embed_batch_matches_the_mean_pooled_reference(client, served):
    result = client.embed(model="me/embed", input=TEXTS)
    assert len(result.embeddings) == len(TEXTS)
    for text, vector in zip(TEXTS, result.embeddings, strict=True):
        ours = np.array(vector)
        assert abs(np.linalg.norm(ours) - 1) < 1e-5
        assert float(ours @ _reference(served[1], text)) >= 0.9999
    assert result.prompt_eval_count == 4 + 2 + 5 + 3 * 2  # words plus [CLS] and [SEP] each
    assert result.total_duration >= result.load_duration >= 0


def test_ollama_embed_string_input_dimensions_and_truncate(client, served):
    one = client.embed(model="me/embed", input="hello world", dimensions=8)
    vector = np.array(one.embeddings[0])
    full = _reference(served[1], "hello world")
    assert vector.shape == (8,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert np.allclose(vector, full[:8] / np.linalg.norm(full[:8]), atol=1e-4)
    long_text = " ".join(["fox"] * 100)  # 102 tokens, the model's context is 64
    assert len(client.embed(model="me/embed", input=long_text).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="me/embed", input=long_text, truncate=False)
    assert refused.value.status_code == 400
    assert "exceeds maximum context length" in refused.value.error


def test_legacy_embeddings_returns_one_vector(client, served):
    result = client.embeddings(model="me/embed", prompt="hello world")
    assert float(np.array(result.embedding) @ _reference(served[1], "hello world")) >= 0.9999
    empty = httpx.post(f"{served[0]}/api/embeddings", json={"model": "me/embed", "prompt": ""})
    assert empty.status_code == 200 and empty.json() == {"embedding": []}


def test_openai_embeddings_float_and_base64(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="ferry", timeout=120)
    floats = client.embeddings.create(model="me/embed", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == 17
    for text, item in zip(TEXTS, floats.data, strict=True):
        assert float(np.array(item.embedding) @ _reference(served[1], text)) >= 0.9999
    raw = httpx.post(f"{served[0]}/v1/embeddings", json={
        "model": "me/embed", "input": "hello world", "encoding_format": "base64",
        "dimensions": 4}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = np.array(struct.unpack("<4f", packed))
    assert abs(np.linalg.norm(decoded) - 1) < 1e-5
    # The openai client decodes base64 itself when it asked for floats without a format.
    default = client.embeddings.create(model="me/embed", input="hello world")
    assert np.allclose(default.data[0].embedding, floats.data[1].embedding, atol=1e-6)


def test_openai_embeddings_errors_use_openai_shape(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="ferry", timeout=120)
    with pytest.raises(openai.BadRequestError, match="does not support embeddings"):
        client.embeddings.create(model="me/tiny", input="hello")
    bad = httpx.post(f"{served[0]}/v1/embeddings", json={"model": "me/embed", "input": [1, 2]})
    assert bad.status_code == 400 and "list of strings" in bad.json()["error"]["message"]
    fmt = httpx.post(f"{served[0]}/v1/embeddings",
                     json={"model": "me/embed", "input": "x", "encoding_format": "int8"})
    assert fmt.status_code == 400


def test_capabilities_and_refusals_both_ways(client, served):
    assert client.show("me/embed").capabilities == ["embedding"]
    assert "embedding" not in client.show("me/tiny").capabilities
    for call in (lambda: client.generate(model="me/embed", prompt="hi"),
                 lambda: client.chat(model="me/embed",
                                     messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400
        assert "does not support generate" in refused.value.error
    for call in (lambda: client.embed(model="me/tiny", input="hi"),
                 lambda: client.embeddings(model="me/tiny", prompt="hi")):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 400
        assert "does not support embeddings" in refused.value.error


def test_bad_embed_requests_are_clear_400s(served):
    url = f"{served[0]}/api/embed"
    for body, message in (({"model": "me/embed", "input": 5}, "list of strings"),
                          ({"model": "me/embed", "input": "x", "dimensions": 0}, "dimensions"),
                          ({"model": "me/embed", "input": "x", "dimensions": 999},
                           "exceeds the model's embedding length"),
                          ({"input": "x"}, "model is required")):
        response = httpx.post(url, json=body, timeout=60)
        assert response.status_code == 400, body
        assert message in response.json()["error"]
    missing = httpx.post(url, json={"model": "me/nothing", "input": "x"})
    assert missing.status_code == 404


def test_options_num_ctx_truncates_and_keep_alive_zero_unloads(client, served):
    long_text = " ".join(["fox"] * 30)
    cut = client.embed(model="me/embed", input=long_text, options={"num_ctx": 8})
    assert cut.prompt_eval_count == 8
    client.embed(model="me/embed", input="hello", keep_alive=0)
    deadline = time.monotonic() + 30
    while any(m.model.startswith("me/embed") for m in client.ps().models):
        assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.1)
