"""The whole product, as a publisher and a client use it, through the `ferry` CLI only.

create (int4) -> list/show -> push to ferry's own registry -> delete locally -> pull back
byte-identical -> run. Every step is a `ferry` subprocess talking to a real model server and a
real registry service on loopback; the runner is the real MLX runner the scheduler spawns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, serve_app


def ferry(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "ferry.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"ferry {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def servers(tmp_path: Path):
    from ferry.app import build_model_server, build_registry_app
    from ferry.config import Settings

    settings = Settings.from_env({"FERRY_HOME": str(tmp_path / "home"),
                                  "FERRY_REGISTRY_ROOT": str(tmp_path / "registry")})
    with serve_app(build_model_server(settings)) as api, \
            serve_app(build_registry_app(settings)) as registry:
        env = dict(os.environ, FERRY_HOME=str(settings.home), FERRY_HOST=api.split("//")[1],
                   FERRY_AUTOSTART="0", NO_COLOR="1", TERM="dumb")
        yield settings, env, registry.split("//")[1]


def test_create_push_delete_pull_run(servers, make_checkpoint, tmp_path: Path) -> None:
    from registry.manifests import parse_manifest
    from registry.names import Name
    from registry.store import Store

    settings, env, registry_host = servers
    checkpoint = make_checkpoint("llama", "tiny")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {checkpoint}\nPARAMETER temperature 0\nPARAMETER num_predict 8\n"
                         "SYSTEM You are terse.\n")

    ferry(env, "create", "me/tiny", "-f", str(modelfile), "--quantize", "int4")
    assert "me/tiny:latest" in ferry(env, "list")
    assert "You are terse." in ferry(env, "show", "me/tiny", "--system")

    remote = f"{registry_host}/me/tiny:v1"
    ferry(env, "cp", "me/tiny", remote)
    ferry(env, "push", "--insecure", remote)

    store = Store(settings.models_dir)
    raw = store.read_manifest(Name.parse_valid(remote))
    blobs = parse_manifest(raw).blob_digests()
    ferry(env, "rm", "me/tiny", remote)
    assert not any(store.has_blob(d) for d in blobs), "rm left blobs no manifest uses"

    ferry(env, "pull", "--insecure", remote)
    assert store.read_manifest(Name.parse_valid(remote)) == raw
    assert all(store.has_blob(d) for d in blobs)

    answer = ferry(env, "run", remote, "hello")
    assert answer.strip(), "ferry run printed nothing"
    ferry(env, "stop", remote)
