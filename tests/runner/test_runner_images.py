"""The runner's /v1/completions with images: the prefix cache reuses an image's tokens only for
the same image, and bad images or a text-only model are clear 400s."""

from __future__ import annotations

import base64
import io
import json
import threading
from pathlib import Path

import httpx
import mlx_models
import numpy as np
import pytest
from arch_checkpoints import write_checkpoint
from conftest import serve_app
from PIL import Image
from test_runner_process import _wait_ready

from registry.names import Name
from runner.server import build_app
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture
created_model = mlx_models.created_model  # fixture
GREEDY = {"temperature": 0, "num_predict": 2}


def _image(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (12, 12, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def url(model_store, make_checkpoint, tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("vision"), "gemma3_mm",
                                  Path(make_checkpoint("llama")), boi_token_index=2045,
                                  eoi_token_index=2046)
    create(Name.parse_valid("vis/gemma3"), checkpoint, CreateOptions(), model_store,
           progress=lambda event: None, cancel=threading.Event())
    with serve_app(build_app(model_store, "vis/gemma3", "float32")) as url:
        _wait_ready(url)
        yield url


def _complete(url: str, *images: str, text: str = "what is in the picture") -> dict:
    body = {"messages": [{"role": "user", "content": text, "images": list(images)}],
            "options": GREEDY}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return json.loads(response.text.strip().splitlines()[-1])


def test_prefix_cache_keys_images_by_content(url):
    first = _complete(url, _image(1))
    again = _complete(url, _image(1))
    other = _complete(url, _image(2))
    total = first["prompt_eval_count"] + first["prompt_cached"]
    assert again["prompt_cached"] == total - 1  # everything but the last prompt token
    # a different image: only what comes before the image is reused
    assert other["prompt_cached"] < total - 4 - 1
    assert other["prompt_eval_count"] + other["prompt_cached"] == total


@pytest.mark.parametrize(("images", "message"), [
    ([base64.b64encode(b"GIF89a broken").decode()], "not a recognised image"),
    (["!!! not base64 !!!"], "not valid base64"),
    ([""], "non-empty base64"),
])
def test_bad_images_are_400(url, images, message):
    body = {"messages": [{"role": "user", "content": "hi", "images": images}]}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and message in response.json()["error"]


def test_text_only_model_refuses_images(model_store, created_model):
    with serve_app(build_app(model_store, created_model("llama"), "float32")) as url:
        _wait_ready(url)
        body = {"prompt": "hi", "images": [_image(1)]}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "text-only model" in response.json()["error"]
