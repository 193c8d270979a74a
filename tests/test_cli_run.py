"""`ferry run`, `ferry ps` and `ferry stop` against a real model server and runner.

`ferry run` is driven through a pseudo-terminal, as a person would use it. The tiny model answers
greedily, so what the CLI prints must be exactly what /api/chat answers for the same
conversation, which proves the prompt, the multi-line input and the history reached the model.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from conftest import REPO
from served_model import serve_tiny_model

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_checkpoint):
    with serve_tiny_model(tmp_path_factory.mktemp("home"), make_checkpoint) as served:
        yield served


def cli_env(served) -> dict[str, str]:
    env = dict(os.environ)
    env.update(FERRY_HOME=str(served.settings.home), FERRY_HOST=served.url.split("//")[1],
               FERRY_AUTOSTART="0", TERM="dumb")
    return env


def answer(served, messages: list[dict]) -> str:
    response = httpx.post(f"{served.url}/api/chat", timeout=120, json={
        "model": served.model, "messages": messages, "stream": False})
    response.raise_for_status()
    return response.json()["message"]["content"]


class Terminal:
    """A child process on a pseudo-terminal: write keystrokes, wait for output."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                        start_new_session=True, cwd=REPO)
        os.close(slave)
        self.output = ""

    def _read(self, timeout: float) -> bool:
        """Append what the child wrote within `timeout`; False once the terminal is closed."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 4096).decode(errors="replace")
        except OSError:  # the child exited and closed the terminal
            return False
        self.output += ANSI.sub("", chunk).replace("\r\n", "\n").replace("\r", "")
        return bool(chunk)

    def expect(self, text: str, timeout: float = 120.0) -> str:
        """Read until `text` appears after what earlier calls consumed; return what came before."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert time.monotonic() < deadline, f"never saw {text!r}; got {self.output!r}"
            if not self._read(0.2):
                assert text in self.output, f"exited before {text!r}: {self.output!r}"
        before, _, self.output = self.output.partition(text)
        return before

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def wait(self, timeout: float = 60.0) -> int:
        """Collect the rest of the output and the exit status."""
        deadline = time.monotonic() + timeout
        while self._read(0.2) or self.process.poll() is None:
            assert time.monotonic() < deadline, f"the CLI did not exit: {self.output!r}"
        os.close(self.master)
        return self.process.wait()


def ferry(*args: str) -> list[str]:
    return [sys.executable, "-P", "-m", "ferry.cli", *args]


def test_one_shot_prints_the_answer(served):
    expected = answer(served, [{"role": "user", "content": "hello there"}])
    term = Terminal(ferry("run", "--verbose", served.model, "hello", "there"), cli_env(served))
    assert term.wait() == 0
    assert expected.strip() and expected.strip() in term.output
    assert re.search(r"eval count:\s+[1-8] token\(s\)", term.output)  # --verbose timings


def test_interactive_chat_keeps_history_and_reads_multi_line_input(served):
    first = "line one\nline two"
    term = Terminal(ferry("run", served.model), cli_env(served))
    term.expect(">>> ")
    term.send('"""')
    term.send("line one")
    term.send('line two"""')
    reply = term.expect(">>> ")
    expected = answer(served, [{"role": "user", "content": first}])
    assert expected.strip() and expected.strip() in reply
    term.send("and again")
    reply = term.expect(">>> ")
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": expected},
               {"role": "user", "content": "and again"}]
    second = answer(served, history).strip()
    assert second and second in reply
    assert second != answer(served, [{"role": "user", "content": "and again"}]).strip()
    term.send("/nope")
    assert "Unknown command '/nope'" in term.expect(">>> ")
    term.send("/bye")
    assert term.wait() == 0


def test_interactive_set_commands_shape_the_next_request(served):
    term = Terminal(ferry("run", served.model), cli_env(served))
    term.expect(">>> ")
    term.send("/set system Answer in one word.")
    assert "Set system message." in term.expect(">>> ")
    term.send("/set parameter num_predict 3")
    assert "Set parameter 'num_predict' to '3'" in term.expect(">>> ")
    term.send("hello there")
    reply = term.expect(">>> ")
    response = httpx.post(f"{served.url}/api/chat", timeout=120, json={
        "model": served.model, "stream": False, "options": {"num_predict": 3},
        "messages": [{"role": "system", "content": "Answer in one word."},
                     {"role": "user", "content": "hello there"}]}).json()
    assert response["eval_count"] <= 3
    assert response["message"]["content"].strip() in reply
    without_system = httpx.post(f"{served.url}/api/chat", timeout=120, json={
        "model": served.model, "stream": False, "options": {"num_predict": 3},
        "messages": [{"role": "user", "content": "hello there"}]}).json()
    assert without_system["message"]["content"] != response["message"]["content"]
    term.send("/bye")
    assert term.wait() == 0


def test_ps_and_stop(served):
    env = cli_env(served)
    answer(served, [{"role": "user", "content": "warm up"}])
    ps = subprocess.run(ferry("ps"), env=env, capture_output=True, text=True, timeout=60)
    assert ps.returncode == 0, ps.stderr
    assert re.search(r"me/tiny:latest\s+[0-9a-f]{12}\s+.*100% CPU", ps.stdout)
    stop = subprocess.run(ferry("stop", served.model), env=env, capture_output=True, text=True,
                          timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert httpx.get(f"{served.url}/api/ps").json()["models"] == []
    again = subprocess.run(ferry("stop", served.model), env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 1 and "couldn't find model" in again.stderr


def test_run_without_a_server_says_how_to_start_one(served, tmp_path):
    env = cli_env(served)
    env["FERRY_HOST"] = "127.0.0.1:9"
    result = subprocess.run(ferry("run", served.model, "hi"), env=env, capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "ferry serve" in result.stderr


def test_autostart_starts_a_server_that_reaps_its_runner_on_sigterm(served, tmp_path):
    from conftest import free_port

    env = cli_env(served)
    env.update(FERRY_AUTOSTART="1", FERRY_HOST=f"127.0.0.1:{free_port()}")
    try:
        result = subprocess.run(ferry("run", served.model, "hello", "there"), env=env,
                                cwd=REPO, capture_output=True, text=True, timeout=120,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr
        expected = answer(served, [{"role": "user", "content": "hello there"}])
        assert expected.strip() in result.stdout
        (server,) = started_servers(env["FERRY_HOST"])
        runners = server.children()
        assert len(runners) == 1  # the model stays loaded for keep_alive
        server.terminate()
        server.wait(30)
        assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in runners)
    finally:
        for leftover in started_servers(env["FERRY_HOST"]):
            leftover.kill()


def started_servers(host: str) -> list[psutil.Process]:
    """`ferry serve` processes started for FERRY_HOST=host (autostart detaches them)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "serve" in (proc.info["cmdline"] or []) and \
                    proc.environ().get("FERRY_HOST") == host:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_run_pulls_a_model_the_store_lacks(served, tmp_path):
    from conftest import serve_app

    from registry.service.app import build_registry_app

    def post(path: str, body: dict) -> None:
        httpx.post(f"{served.url}{path}", json=body, timeout=120).raise_for_status()

    with serve_app(build_registry_app(tmp_path / "registry")) as registry:
        remote = f"{registry.removeprefix('http://')}/me/tiny:latest"
        post("/api/copy", {"source": served.model, "destination": remote})
        post("/api/push", {"model": remote, "insecure": True, "stream": False})
        httpx.request("DELETE", f"{served.url}/api/delete", json={"model": remote},
                      timeout=60).raise_for_status()
        result = subprocess.run(ferry("run", "--insecure", remote, "hello", "there"),
                                env=cli_env(served), cwd=REPO, capture_output=True, text=True,
                                timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "success" in result.stderr
    expected = answer(served, [{"role": "user", "content": "hello there"}])
    assert expected.strip() and expected.strip() in result.stdout
    names = [m["name"] for m in httpx.get(f"{served.url}/api/tags").json()["models"]]
    assert remote in names
    post("/api/generate", {"model": remote, "keep_alive": 0})  # unload its runner
