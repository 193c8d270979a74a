"""The runner's POST /v1/embed (docs/runner-protocol.md), in-process on loopback."""

from __future__ import annotations

import threading

import httpx
import mlx_models
import pytest
from conftest import serve_app
from test_runner_process import _wait_ready

from registry.names import Name
from runner.server import build_app
from tests.runner.embedding_checkpoints import write_checkpoint
from workflows.create import CreateOptions, create

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures


@pytest.fixture(scope="module")
def embed_url(model_store, tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("xlmr"), "xlm_roberta", "mean")
    create(Name.parse_valid("emb/xlmr"), checkpoint, CreateOptions(), model_store,
           progress=lambda event: None, cancel=threading.Event())
    with serve_app(build_app(model_store, "emb/xlmr", "float32")) as url:
        _wait_ready(url)
        yield url


def test_embed_answers_one_vector_per_input_with_counts(embed_url):
    body = {"input": ["hello world", "the cat sat on the mat"], "dimensions": 16}
    answer = httpx.post(f"{embed_url}/v1/embed", json=body, timeout=60).json()
    assert [len(v) for v in answer["embeddings"]] == [16, 16]
    assert answer["prompt_eval_count"] == 4 + 8  # <s> ... </s> around each
    assert answer["prompt_eval_duration"] > 0


def test_embedding_runner_refuses_generation_and_bad_bodies(embed_url):
    refused = httpx.post(f"{embed_url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert refused.status_code == 400 and "does not support generate" in refused.json()["error"]
    for body, message in (({"input": "not a list"}, "embed needs"),
                          ({"input": ["x"], "dimensions": -1}, "dimensions"),
                          ({"input": ["x"], "options": {"num_ctx": "big"}}, "num_ctx"),
                          ({"input": ["fox " * 80], "truncate": False}, "exceeds maximum")):
        response = httpx.post(f"{embed_url}/v1/embed", json=body, timeout=60)
        assert response.status_code == 400, body
        assert message in response.json()["error"]


def test_generation_runner_refuses_embed(model_store, created_model):
    with serve_app(build_app(model_store, created_model("llama"), "float32")) as url:
        _wait_ready(url)
        response = httpx.post(f"{url}/v1/embed", json={"input": ["hi"]}, timeout=60)
    assert response.status_code == 400
    assert "does not support embeddings" in response.json()["error"]
