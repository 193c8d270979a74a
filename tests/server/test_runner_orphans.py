"""Runners never outlive their server: SIGKILL `ferry serve` with two models loaded and both
runner processes exit within seconds (the parent-death signal the real runner arms)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from conftest import free_port
from runner_fakes import add_model

HERE = Path(__file__).parent


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_runners_exit_when_the_server_is_killed(settings, store) -> None:
    for model in ("me/one", "me/two"):
        add_model(store, model)
    port = free_port()
    env = {**os.environ, "FERRY_HOME": str(settings.home), "FERRY_NOPRUNE": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, str(HERE / "serve_with_fake_runners.py"),
                               str(port)], env=env)
    runners: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/api/version", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        for model in ("me/one", "me/two"):
            r = httpx.post(f"{url}/api/generate", json={"model": model}, timeout=30)
            assert r.status_code == 200, r.text
        assert len(httpx.get(f"{url}/api/ps", timeout=5).json()["models"]) == 2
        runners = [c.pid for c in psutil.Process(server.pid).children()]
        assert len(runners) == 2
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        assert wait_gone(runners, 10) == []
    finally:
        server.kill()
        server.wait(10)
        for pid in runners:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


GRANDCHILD = """
import os, time
import ferry.commands.runner as runner
runner._set_parent_death_signal = lambda: False  # as on a platform without prctl
runner.PARENT_POLL_SECONDS = 0.1
runner.die_with_parent()
print(os.getpid(), flush=True)
time.sleep(60)
"""
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
time.sleep(60)
"""


def test_the_parent_watch_ends_a_runner_where_prctl_is_missing() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, GRANDCHILD],
                              stdout=subprocess.PIPE, env=os.environ.copy())
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()
        parent.wait(10)
        assert wait_gone([child], 5) == []
    finally:
        parent.kill()
        parent.wait(10)
