"""`ferry create` with upload sessions: the server quantizes a shard while it streams in, and
publishes only after the client's digest matched every byte (issue 15)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ferry.app import build_model_server
from ferry.cli import main
from ferry.config import Settings
from registry.digests import Digest
from registry.names import Name
from registry.store import Store
from registry.upload_sessions import Upload, Uploads
from tests.conftest import serve_app

from .helpers import stage_tree, upload_dir

SHARD = "model.safetensors"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def cli_env(model_server, settings, monkeypatch):
    monkeypatch.setenv("FERRY_HOST", model_server.removeprefix("http://"))
    monkeypatch.setenv("FERRY_HOME", str(settings.home))  # the CLI's digest cache goes there
    return model_server


def _manifest(store: Store, name: str) -> bytes:
    return store.read_manifest(Name.parse(name))


def _temp_files(store: Store) -> list[Path]:
    return sorted(store.blobs_dir.glob(".tmp-*")) + stage_tree(store)


def _sequential_create(url: str, store: Store, ckpt: Path, name: str, quantize: str) -> None:
    """The Ollama flow: every file a blob first, then /api/create naming digests."""
    files = upload_dir(store, ckpt)
    response = httpx.post(f"{url}/api/create", timeout=120,
                          json={"model": name, "files": files, "quantize": quantize,
                                "stream": False})
    assert response.status_code == 200, response.text


def _start_create(url: str, body: dict, out: list) -> threading.Thread:
    """POST /api/create in a thread (it waits for the upload); its lines land in `out`."""
    def run() -> None:
        with httpx.stream("POST", f"{url}/api/create", json=body, timeout=120) as response:
            out.append(response.status_code)
            out.extend(json.loads(line) for line in response.iter_lines() if line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _session_body(url: str, store: Store, ckpt: Path, name: str, size: int) -> tuple[str, dict]:
    upload_id = httpx.post(f"{url}/api/uploads", json={"size": size}).json()["id"]
    files = upload_dir(store, ckpt, skip=(SHARD,))
    files[SHARD] = f"upload:{upload_id}"
    return upload_id, {"model": name, "files": files, "quantize": "int4"}


def _pieces(data: bytes, n: int, pause: float = 0.05) -> Iterator[bytes]:
    step = -(-len(data) // n)
    for i in range(0, len(data), step):
        time.sleep(pause)  # the create is already waiting for these bytes
        yield data[i:i + step]


def test_cli_streams_the_weights_and_matches_the_sequential_create(
        cli_env, store, make_checkpoint, tmp_path, capsys, monkeypatch):
    sessions: list[int] = []
    start = Uploads.start
    monkeypatch.setattr(Uploads, "start", lambda self, size: sessions.append(size)
                        or start(self, size))
    ckpt = make_checkpoint("llama")
    (tmp_path / "Modelfile").write_text(f"FROM {ckpt}\n")
    assert main(["create", "me/streamed", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 0
    assert sessions == [(ckpt / SHARD).stat().st_size]  # the shard went through a session
    capsys.readouterr()
    streamed = _manifest(store, "me/streamed")
    # The same checkpoint through Ollama's flow gives the same bytes, layer for layer.
    _sequential_create(cli_env, store, ckpt, "me/sequential", "int4")
    assert _manifest(store, "me/sequential") == streamed
    assert _temp_files(store) == []
    # Unchanged files are not sent again: the digest cache names them, the server has them.
    assert main(["create", "me/again", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 0
    err = capsys.readouterr().err
    assert "uploaded" not in err and "using existing model.safetensors" in err
    assert len(sessions) == 1
    assert _manifest(store, "me/again") == streamed


def test_create_waits_for_bytes_that_arrive_after_it_started(model_server, store,
                                                             make_checkpoint):
    ckpt = make_checkpoint("llama")
    data = (ckpt / SHARD).read_bytes()
    upload_id, body = _session_body(model_server, store, ckpt, "me/late", len(data))
    lines: list = []
    create = _start_create(model_server, body, lines)
    time.sleep(0.3)
    assert create.is_alive()  # nothing to read yet: the create waits
    sent = httpx.patch(f"{model_server}/api/uploads/{upload_id}", content=_pieces(data, 8))
    assert sent.status_code == 204
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    done = httpx.put(f"{model_server}/api/uploads/{upload_id}", params={"digest": digest})
    assert done.status_code == 201 and done.json()["digest"] == digest
    create.join(60)
    assert lines[0] == 200 and lines[-1] == {"status": "success"}
    # The verified upload becomes a blob after the create published (durable off its path).
    deadline = time.monotonic() + 30
    while not store.has_blob(Digest.parse(digest)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.has_blob(Digest.parse(digest)) and _temp_files(store) == []
    _sequential_create(model_server, store, ckpt, "me/seq", "int4")
    assert _manifest(store, "me/late") == _manifest(store, "me/seq")
    assert _temp_files(store) == []


def test_a_lying_digest_publishes_nothing(model_server, store, make_checkpoint):
    ckpt = make_checkpoint("llama")
    data = (ckpt / SHARD).read_bytes()
    upload_id, body = _session_body(model_server, store, ckpt, "me/liar", len(data))
    lines: list = []
    create = _start_create(model_server, body, lines)
    assert httpx.patch(f"{model_server}/api/uploads/{upload_id}",
                       content=_pieces(data, 4)).status_code == 204
    wrong = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    refused = httpx.put(f"{model_server}/api/uploads/{upload_id}", params={"digest": wrong})
    assert refused.status_code == 400 and "mismatch" in refused.json()["error"]
    create.join(60)
    assert "error" in lines[-1] and "mismatch" in lines[-1]["error"]
    assert [m.name for m in store.list_models()] == []
    assert _temp_files(store) == []
    assert not store.has_blob(Digest.parse(wrong))


def test_a_client_gone_mid_upload_publishes_nothing(model_server, store, make_checkpoint):
    ckpt = make_checkpoint("llama")
    data = (ckpt / SHARD).read_bytes()
    upload_id, body = _session_body(model_server, store, ckpt, "me/gone", len(data))
    lines: list = []
    create = _start_create(model_server, body, lines)

    def half_then_die() -> Iterator[bytes]:
        yield data[: len(data) // 2]
        time.sleep(0.2)
        raise ConnectionAbortedError("the client was killed")

    with pytest.raises(ConnectionAbortedError):
        httpx.patch(f"{model_server}/api/uploads/{upload_id}", content=half_then_die(),
                    headers={"Content-Length": str(len(data))})
    create.join(60)
    assert not create.is_alive()
    assert "error" in lines[-1]
    assert [m.name for m in store.list_models()] == []
    assert _temp_files(store) == []


def test_a_stalled_upload_fails_the_create(tmp_path, make_checkpoint):
    settings = Settings.from_env({"FERRY_HOME": str(tmp_path / "home"),
                                  "FERRY_UPLOAD_STALL_TIMEOUT": "1s"})
    store = Store(settings.models_dir)
    ckpt = make_checkpoint("llama")
    with serve_app(build_model_server(settings)) as url:
        size = (ckpt / SHARD).stat().st_size
        _, body = _session_body(url, store, ckpt, "me/stalled", size)
        lines: list = []
        _start_create(url, body, lines).join(60)
    assert "no bytes arrived for 1 s" in lines[-1]["error"]
    assert [m.name for m in store.list_models()] == []
    assert _temp_files(store) == []


def test_sessions_are_refused_where_they_do_not_belong(model_server, store, make_checkpoint):
    ckpt = make_checkpoint("llama")
    upload_id = httpx.post(f"{model_server}/api/uploads", json={"size": 10}).json()["id"]
    files = upload_dir(store, ckpt)
    for field, rel, message in (("files", "config.json", "only *.safetensors"),
                                ("files", SHARD, "not found"),
                                ("draft_files", SHARD, "name a blob digest here")):
        ref = f"upload:{upload_id}" if message != "not found" else "upload:nope"
        body = {"model": "me/x", "files": files, "stream": False,
                field: {**(files if field == "files" else {}), rel: ref}}
        response = httpx.post(f"{model_server}/api/create", json=body)
        assert response.status_code == 400 and message in response.json()["error"]
    assert httpx.post(f"{model_server}/api/uploads", json={"size": -1}).status_code == 400
    # A size the disk cannot hold is refused up front (the file would be reserved sparse),
    # and so is one that fits alone but not beside what open sessions still expect.
    huge = httpx.post(f"{model_server}/api/uploads", json={"size": 2**62})
    assert huge.status_code == 413 and "exceeds" in huge.json()["error"]
    free = shutil.disk_usage(store.root).free
    first = httpx.post(f"{model_server}/api/uploads", json={"size": free // 2 + 2**20})
    assert first.status_code == 201
    second = httpx.post(f"{model_server}/api/uploads", json={"size": free // 2 + 2**20})
    assert second.status_code == 413
    assert httpx.delete(f"{model_server}/api/uploads/{first.json()['id']}").status_code == 204
    assert httpx.patch(f"{model_server}/api/uploads/nope", content=b"x").status_code == 404
    # More bytes than declared: refused, and the session is gone with its temp file.
    assert httpx.patch(f"{model_server}/api/uploads/{upload_id}",
                       content=b"x" * 11).status_code == 400
    assert httpx.delete(f"{model_server}/api/uploads/{upload_id}").status_code == 204
    assert _temp_files(store) == []


def test_cli_falls_back_to_blobs_on_a_server_without_sessions(settings, store, make_checkpoint,
                                                              tmp_path, monkeypatch, capsys):
    app = build_model_server(settings)  # as Ollama (or an older ferry) answers: no /api/uploads
    app.router.routes = [r for r in app.router.routes
                         if not getattr(r, "path", "").startswith("/api/uploads")]
    ckpt = make_checkpoint("llama")
    (tmp_path / "Modelfile").write_text(f"FROM {ckpt}\n")
    with serve_app(app) as url:
        monkeypatch.setenv("FERRY_HOST", url.removeprefix("http://"))
        monkeypatch.setenv("FERRY_HOME", str(settings.home))
        assert main(["create", "me/plain", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 0
        assert "uploaded model.safetensors" in capsys.readouterr().err
        _sequential_create(url, store, ckpt, "me/seq", "int4")
    assert _manifest(store, "me/plain") == _manifest(store, "me/seq")


def test_a_killed_cli_leaves_no_manifest_and_no_temp_files(settings, store, wide_checkpoint,
                                                           tmp_path, monkeypatch):
    """SIGKILL a real `ferry create` while its shard is half sent."""
    written = Upload._written

    def slow(self: Upload, total: int) -> None:
        time.sleep(0.05)  # 4 MiB at a time: the ~66 MB shard takes about a second to arrive
        written(self, total)

    monkeypatch.setattr(Upload, "_written", slow)
    app = build_model_server(settings)
    (tmp_path / "Modelfile").write_text(f"FROM {wide_checkpoint}\n")
    with serve_app(app) as url:
        env = {**os.environ, "FERRY_HOST": url.removeprefix("http://"),
               "FERRY_HOME": str(settings.home), "PYTHONPATH": str(REPO)}
        cli = subprocess.Popen([sys.executable, "-m", "ferry.cli", "create", "me/killed", "-f",
                                str(tmp_path / "Modelfile"), "-q", "int4"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not any(u.received for u in list(app.state.uploads._sessions.values())):
                assert time.monotonic() < deadline and cli.poll() is None
                time.sleep(0.005)
        finally:
            cli.kill()
            cli.wait()
        deadline = time.monotonic() + 30
        while _temp_files(store) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert [m.name for m in store.list_models()] == []
    assert _temp_files(store) == []


def test_cli_streams_every_shard_of_a_sharded_checkpoint(cli_env, store, make_checkpoint,
                                                         tmp_path, monkeypatch):
    sessions: list[int] = []
    start = Uploads.start
    monkeypatch.setattr(Uploads, "start", lambda self, size: sessions.append(size)
                        or start(self, size))
    ckpt = make_checkpoint("qwen3", shard_mb=1.0)
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 1
    (tmp_path / "Modelfile").write_text(f"FROM {ckpt}\n")
    assert main(["create", "me/sharded", "-f", str(tmp_path / "Modelfile"), "-q", "int8"]) == 0
    assert sorted(sessions) == sorted(p.stat().st_size for p in shards)
    _sequential_create(cli_env, store, ckpt, "me/seq", "int8")
    assert _manifest(store, "me/sharded") == _manifest(store, "me/seq")
    assert _temp_files(store) == []


def test_a_refused_create_abandons_its_sessions(cli_env, store, make_checkpoint, tmp_path,
                                                capsys, monkeypatch):
    written = Upload._written

    def slow(self: Upload, total: int) -> None:
        time.sleep(0.3)  # the refusal comes while the first shard is still on its way
        written(self, total)

    monkeypatch.setattr(Upload, "_written", slow)
    ckpt = make_checkpoint("qwen3", shard_mb=1.0)
    (tmp_path / "Modelfile").write_text(f"FROM {ckpt}\n")
    assert main(["create", "me/bad", "-f", str(tmp_path / "Modelfile"), "-q", "int3"]) == 1
    assert "int3" in capsys.readouterr().err
    deadline = time.monotonic() + 10
    while _temp_files(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _temp_files(store) == [] and store.list_models() == []
