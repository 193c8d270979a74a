"""A GGUF file through the whole model server: `/api/create` wraps it, `/api/generate` and
`/api/chat` run it in a real runner process; a GGUF the runner cannot load fails with its
reason and leaves no runner behind."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from conftest import runner_processes

from tests.runner.gguf_export import export_gguf

OPTIONS = {"temperature": 0, "num_predict": 6}


def _create(url: str, store, path: Path, name: str) -> None:
    digest = store.blob_writer().write_all(path.read_bytes())
    resp = httpx.post(f"{url}/api/create", timeout=60, json={
        "model": name, "files": {path.name: str(digest)}, "stream": False})
    assert resp.json() == {"status": "success"}, resp.text


def _no_runner_left() -> bool:
    deadline = time.monotonic() + 10
    while runner_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not runner_processes()


@pytest.mark.parametrize("qtype", ["Q8_0"])
def test_created_gguf_generates_and_chats(model_server, store, make_checkpoint, tmp_path, qtype):
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "tiny.gguf", qtype)
    _create(model_server, store, path, "me/gguf")
    gen = httpx.post(f"{model_server}/api/generate", timeout=120, json={
        "model": "me/gguf", "prompt": "hello there", "stream": False, "options": OPTIONS})
    assert gen.status_code == 200, gen.text
    assert gen.json()["done"] and gen.json()["eval_count"] >= 1
    chat = httpx.post(f"{model_server}/api/chat", timeout=120, json={
        "model": "me/gguf", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": OPTIONS})
    assert chat.status_code == 200, chat.text
    # the chat template came from tokenizer.chat_template: the fixture tokenizer encodes
    # "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" as 16 tokens
    # (prompt_eval_count counts the whole prompt, cached or not)
    assert chat.json()["prompt_eval_count"] == 16
    httpx.post(f"{model_server}/api/generate", json={"model": "me/gguf", "keep_alive": 0})
    assert _no_runner_left()


def test_gguf_without_tokenizer_is_refused_at_create(model_server, store, make_checkpoint,
                                                     tmp_path):
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "bare.gguf", tokenizer=False)
    digest = store.blob_writer().write_all(path.read_bytes())
    resp = httpx.post(f"{model_server}/api/create", timeout=60, json={
        "model": "me/bare", "files": {path.name: str(digest)}, "stream": False})
    assert resp.status_code == 400
    assert "GGUF model has no tokenizer" in resp.json()["error"]


def test_gguf_the_runner_cannot_load_fails_with_its_reason(model_server, store,
                                                           make_checkpoint, tmp_path):
    raw = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf").read_bytes()
    length = len(b"llama").to_bytes(8, "little")
    path = tmp_path / "llamo.gguf"  # an architecture no runner file serves
    path.write_bytes(raw.replace(b"llama.", b"llamo.").replace(length + b"llama",
                                                                length + b"llamo"))
    _create(model_server, store, path, "me/llamo")
    resp = httpx.post(f"{model_server}/api/generate", timeout=120, json={
        "model": "me/llamo", "prompt": "hi", "stream": False})
    assert resp.status_code >= 400, resp.text
    assert "GGUF architecture 'llamo' is not supported" in resp.json()["error"]
    assert _no_runner_left()
