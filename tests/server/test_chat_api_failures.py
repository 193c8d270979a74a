"""The chat API when runners misbehave: killed mid-request, slow, or gone.

A real model server on loopback whose scheduler spawns the stand-in runner (fake_runner.py),
because these failures cannot be produced on demand by a real model. Everything a client sees
through the real runner is tested in test_chat_api.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from conftest import runner_processes, serve_app
from runner_fakes import add_model, fake_command

from server.scheduler import Scheduler


@pytest.fixture
def fake_server(settings, store, tmp_path):
    """Start a model server whose runners are fake_runner.py with `extra` arguments."""
    from ferry.app import build_model_server

    def start(*extra: str):
        scheduler = Scheduler(settings, store, command=fake_command(*extra), overhead=1024)
        return serve_app(build_model_server(settings, scheduler=scheduler))

    add_model(store, "me/tiny")
    return start


def stream_lines(client: httpx.Client, path: str, body: dict):
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                yield json.loads(line)


def test_killed_runner_fails_the_request_and_the_next_one_reloads(fake_server):
    with fake_server("--token-delay", "0.3", "--tokens", "30") as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        lines = stream_lines(client, "/api/generate", {"model": "me/tiny", "prompt": "hi"})
        assert next(lines)["response"] == "tok0 "
        (runner,) = client.get("/api/ps").json()["models"]
        (proc,) = runner_processes()
        pid = proc.pid
        os.kill(pid, signal.SIGKILL)
        rest = list(lines)
        assert "error" in rest[-1] and "terminated" in rest[-1]["error"]
        again = client.post("/api/generate", json={"model": "me/tiny", "prompt": "hi",
                                                   "stream": False, "options": {"num_predict": 2}})
        assert again.status_code == 200, again.text
        assert again.json()["response"] == "tok0 tok1 "
        assert runner["name"] == "me/tiny:latest"
    assert runner_processes() == []


def test_server_shutdown_reaps_its_runners(fake_server):
    with fake_server() as url:
        httpx.post(f"{url}/api/generate", json={"model": "me/tiny", "keep_alive": -1},
                   timeout=60).raise_for_status()
        assert len(runner_processes()) == 1
    assert runner_processes() == []


@pytest.mark.parametrize("path", ["/api/generate", "/v1/chat/completions"])
def test_a_client_that_gives_up_on_a_non_streaming_answer_stops_the_generation(
        fake_server, tmp_path, path):
    log = tmp_path / "completions.log"
    body = {"model": "me/tiny", "prompt": "hi", "stream": False,
            "messages": [{"role": "user", "content": "hi"}]}
    with fake_server("--token-delay", "0.1", "--tokens", "200", "--log", str(log)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}{path}", json=body, timeout=httpx.Timeout(60, read=2.0))
        deadline = time.monotonic() + 30
        while not log.exists() or not log.read_text():
            assert time.monotonic() < deadline, "the runner never finished or stopped"
            time.sleep(0.1)
        assert log.read_text().startswith("cut "), log.read_text()


def test_a_client_that_closes_a_stream_stops_the_generation(fake_server, tmp_path):
    log = tmp_path / "completions.log"
    with fake_server("--token-delay", "0.1", "--tokens", "200", "--log", str(log)) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        lines = stream_lines(client, "/api/chat", {
            "model": "me/tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert next(lines)["message"]["content"] == "tok0 "
        lines.close()
        deadline = time.monotonic() + 30
        while not log.exists() or not log.read_text():
            assert time.monotonic() < deadline, "the runner never finished or stopped"
            time.sleep(0.1)
        assert log.read_text().startswith("cut "), log.read_text()
