"""The runner process end to end: a real `ferry runner` child on a free loopback port, and the
same app in-process to watch cancellation from the inside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlx_models
import pytest
from conftest import free_port, serve_app

from ferry.commands.runner import preload_env
from ferry.config import Settings
from runner.server import build_app

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures

REPO = Path(__file__).resolve().parents[2]


def _wait_ready(url: str, process: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            err = process.stderr.read().decode() if process.stderr else ""
            pytest.fail(f"runner exited: {err}")
        try:
            status = httpx.get(f"{url}/v1/status", timeout=2).json()
            if status["status"] == "ready":
                return status
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail("runner did not become ready")


@pytest.fixture(scope="module")
def runner_url(model_store, created_model):
    name = created_model("llama", "int4")
    port = free_port()
    env = {**os.environ, "FERRY_MODELS": str(model_store.root), "FERRY_COMPUTE": "auto"}
    env.pop("LD_PRELOAD", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "ferry.cli", "runner", "--model", name, "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, _wait_ready(url, process), name
    finally:
        process.terminate()
        assert process.wait(timeout=15) is not None


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.iter_lines() if line]


def test_runner_process_reports_status_and_compute_path(runner_url):
    _, status, name = runner_url
    assert status["model"] == name
    assert status["context_length"] == 2048
    assert status["compute"] == "fused"  # auto on a CPU, int4 model: packed weights, fused kernel
    assert status["memory"]["rss"] > status["memory"]["weights"] > 0
    assert status["progress"] == 1.0
    if sys.platform.startswith("linux") and Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                                                 "libblas.so.3").is_file():
        assert status["blas"] == "openblas"  # the command preloaded it by re-executing


def test_runner_process_streams_completions(runner_url):
    url, _, _ = runner_url
    lines = _stream(url, {"messages": [{"role": "user", "content": "hello"}],
                          "options": {"temperature": 0, "num_predict": 20}})
    *pieces, final = lines
    assert pieces and all(p["done"] is False and isinstance(p["content"], str) for p in pieces)
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    assert final["prompt_eval_count"] > 5 and final["prompt_eval_duration"] > 0
    assert 0 < final["eval_count"] <= 20 and final["eval_duration"] > 0
    again = _stream(url, {"prompt": "hello", "options": {"temperature": 0, "num_predict": 20}})
    assert "".join(p["content"] for p in again) == "".join(p["content"] for p in lines)


def test_runner_process_tokenizes_and_refuses_bad_requests(runner_url):
    url, _, _ = runner_url
    tokens = httpx.post(f"{url}/v1/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    too_long = httpx.post(f"{url}/v1/completions", json={
        "prompt": "word " * 400, "raw": True, "truncate": False, "options": {"num_ctx": 64}})
    assert too_long.status_code == 400 and "context length 64" in too_long.json()["error"]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "options": {"top_k": "a"}})
    assert bad.status_code == 400 and "top_k" in bad.json()["error"]
    assert httpx.post(f"{url}/v1/completions", json={"nothing": 1}).status_code == 400


def test_client_disconnect_stops_generation(model_store, created_model):
    app = build_app(model_store, created_model("llama"), "float32")
    state = app.state.runner
    with serve_app(app) as url:
        _wait_ready(url)
        state.tokenizer.eos_ids.clear()
        body = {"prompt": "go", "options": {"num_predict": 1_000_000, "seed": 1}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert json.loads(next(lines))["done"] is False
        # the worker finishes the cancelled request, then runs this one
        final = _stream(url, {"prompt": "go", "options": {"num_predict": 3, "seed": 1}})[-1]
        assert final["eval_count"] == 3
    assert state.generator.generated == 3


def test_load_failure_is_reported_and_ends_the_runner(model_store):
    failures: list[str] = []
    app = build_app(model_store, "no/such-model", "auto", on_fail=failures.append)
    with serve_app(app) as url:
        deadline = time.monotonic() + 30
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        response = httpx.get(f"{url}/v1/status")
    assert failures and "no/such-model" in failures[0]
    assert response.status_code == 500 and "no/such-model" in response.json()["error"]


def test_runner_command_is_hidden_but_has_help():
    ferry = [sys.executable, "-m", "ferry.cli"]
    listing = subprocess.run([*ferry, "--help"], capture_output=True, text=True, cwd=REPO)
    assert "runner " not in listing.stdout
    usage = subprocess.run([*ferry, "help", "runner"], capture_output=True, text=True, cwd=REPO)
    assert usage.returncode == 0 and "--model" in usage.stdout and "--port" in usage.stdout


def test_openblas_preload_only_when_float32_may_be_used(tmp_path):
    blas = tmp_path / "libblas.so.3"
    blas.write_bytes(b"")
    settings = Settings.from_env({"FERRY_HOME": str(tmp_path)})
    env = preload_env(settings, blas)
    if not sys.platform.startswith("linux"):
        assert env is None
        return
    assert env is not None and env["LD_PRELOAD"].split(":")[0] == str(blas)
    assert preload_env(settings.with_(compute="native"), blas) is None
    assert preload_env(settings, tmp_path / "missing.so") is None
