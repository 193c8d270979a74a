"""Images through the real model server and runner: a tiny random-weight Gemma 3 vision model
made with create, asked with the official `ollama` and `openai` clients."""

from __future__ import annotations

import base64
import io
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest
from conftest import serve_app
from PIL import Image
from tokenizers import Tokenizer

from tests.runner.arch_checkpoints import write_checkpoint

MODEL = "me/tiny-vision"
PARAMETERS = {"temperature": 0, "num_predict": 8, "seed": 7}
TOKENS_PER_IMAGE = 4


def _png(seed: int, size: tuple[int, int] = (24, 20)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_checkpoint):
    from ferry.app import build_model_server
    from ferry.config import Settings
    from registry.names import Name
    from registry.store import Store
    from workflows.create import CreateOptions, create

    home = tmp_path_factory.mktemp("home")
    checkpoint = write_checkpoint(home / "ckpt", "gemma3_mm", Path(make_checkpoint("llama")),
                                  boi_token_index=2045, eoi_token_index=2046)
    settings = Settings.from_env({"FERRY_HOME": str(home)})
    store = Store(settings.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse_valid(MODEL), checkpoint, CreateOptions(parameters=PARAMETERS), store,
           progress=lambda event: None, cancel=threading.Event())
    blank = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(
        "\n\n", add_special_tokens=False).ids
    with serve_app(build_model_server(settings)) as url:
        yield Served(url, TOKENS_PER_IMAGE + 2 + 2 * len(blank))


@dataclass(frozen=True)
class Served:
    url: str
    run_length: int  # the prompt tokens one image adds: blank line, start, tokens, end, blank


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url, timeout=120)


def _ask(client, *images: bytes):
    return client.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?",
                                               "images": list(images)}])


def test_show_says_vision(client):
    assert "vision" in client.show(MODEL).capabilities


def test_the_image_reaches_the_vision_tower(client, served):
    plain = client.chat(model=MODEL, messages=[{"role": "user", "content": "what is this?"}])
    first, second = _ask(client, _png(1)), _ask(client, _png(2))
    assert first.prompt_eval_count == plain.prompt_eval_count + served.run_length
    assert _ask(client, _png(1)).message.content == first.message.content
    assert first.message.content != second.message.content  # the features, not the tokens


def test_generate_takes_images(client, served):
    reply = client.generate(model=MODEL, prompt="describe", images=[_png(3)])
    plain = client.generate(model=MODEL, prompt="describe")
    assert reply.prompt_eval_count == plain.prompt_eval_count + served.run_length


@pytest.mark.parametrize(("image", "message"), [
    (base64.b64encode(b"not an image at all").decode(), "not a recognised image"),
    (base64.b64encode(_png(4)[:50]).decode(), "corrupt"),
])
def test_bad_images_are_a_clear_400(client, image, message):
    with pytest.raises(ollama.ResponseError, match=message) as info:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [image]}])
    assert info.value.status_code == 400


def test_openai_image_url_data_urls(served, client):
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=120)
    url = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    reply = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": url}}]}])
    assert reply.choices[0].message.content == _ask(client, _png(1)).message.content
    with pytest.raises(openai.BadRequestError, match="data URL"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}])


def test_repeat_penalty_with_an_image_in_the_history(client):
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "again",
                                                "images": [_png(5)]}],
                        options={"repeat_penalty": 1.3, "repeat_last_n": 64})
    assert reply.done and reply.eval_count == PARAMETERS["num_predict"]


def test_ferry_run_attaches_image_paths(served, tmp_path):
    """`ferry run MODEL "what is ./x.png"`: the same answer as sending the image by API."""
    import os
    import subprocess
    import sys
    (tmp_path / "x.png").write_bytes(_png(1))
    expected = ollama.Client(host=served.url, timeout=120).chat(model=MODEL, messages=[
        {"role": "user", "content": "what is this?", "images": [_png(1)]}]).message.content
    env = {**os.environ, "FERRY_HOST": served.url.split("//")[1], "FERRY_AUTOSTART": "0",
           "FERRY_HOME": str(tmp_path / "home"), "TERM": "dumb"}
    done = subprocess.run([sys.executable, "-P", "-m", "ferry.cli", "run", MODEL,
                           "what is this? ./x.png"], cwd=tmp_path, env=env, timeout=120,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert expected.strip() and done.stdout.strip() == expected.strip()
