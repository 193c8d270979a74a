"""`ferry.send_file`: an upload session's body sent by sendfile over plain http (issue 15)."""

from __future__ import annotations

import hashlib
import os
import time

import httpx
import pytest

from ferry.cli import main
from ferry.commands import create as create_cmd
from ferry.send_file import SendStopped, plain_target, send_file
from registry.digests import Digest, Hasher
from registry.store import Store

from .test_create_streamed import SHARD, _manifest, _sequential_create, _temp_files


def _session(url: str, size: int) -> str:
    response = httpx.post(f"{url}/api/uploads", json={"size": size})
    assert response.status_code == 201
    return str(response.json()["id"])


def test_the_body_arrives_byte_for_byte_and_the_hash_is_the_files(model_server, store,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setattr("ferry.send_file.PIECE", 1 << 20)  # several pieces, one short
    data = os.urandom(3 * (1 << 20) + 12345)
    (tmp_path / "f").write_bytes(data)
    upload_id = _session(model_server, len(data))
    target = plain_target(model_server)
    assert target is not None
    hasher, sent = Hasher(), []
    reply = send_file(target, "PATCH", f"/api/uploads/{upload_id}", tmp_path / "f", len(data),
                      hasher, timeout=30, on_sent=sent.append)
    assert reply.status == 204
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert str(hasher.digest()) == digest and sum(sent) == len(data) and len(sent) == 4
    done = httpx.put(f"{model_server}/api/uploads/{upload_id}", params={"digest": digest})
    assert done.status_code == 201
    assert store.blob_path(Digest.parse(digest)).read_bytes() == data
    assert _temp_files(store) == []


def test_bytes_other_than_the_hashed_ones_are_refused(model_server, store, tmp_path):
    """The server verifies what it received, not what the client says it hashed."""
    data = os.urandom(1 << 20)
    (tmp_path / "f").write_bytes(data)
    upload_id = _session(model_server, len(data))
    target = plain_target(model_server)
    assert target is not None
    reply = send_file(target, "PATCH", f"/api/uploads/{upload_id}", tmp_path / "f", len(data),
                      Hasher(), timeout=30)
    assert reply.status == 204
    other = bytearray(data)
    other[-1] ^= 1  # as if the file changed between its hash and its send
    wrong = "sha256:" + hashlib.sha256(other).hexdigest()
    refused = httpx.put(f"{model_server}/api/uploads/{upload_id}", params={"digest": wrong})
    assert refused.status_code == 400 and "mismatch" in refused.json()["error"]
    assert not store.has_blob(Digest.parse(wrong)) and _temp_files(store) == []


def test_an_early_refusal_is_read_back_and_a_stop_leaves_nothing(model_server, store,
                                                                 tmp_path, monkeypatch):
    (tmp_path / "f").write_bytes(b"x" * 11)
    target = plain_target(model_server)
    assert target is not None
    too_long = _session(model_server, 10)
    reply = send_file(target, "PATCH", f"/api/uploads/{too_long}", tmp_path / "f", 11,
                      Hasher(), timeout=30)
    assert reply.status == 400 and b"longer than the declared" in reply.body
    missing = send_file(target, "PATCH", "/api/uploads/nope", tmp_path / "f", 11, Hasher(),
                        timeout=30)
    assert missing.status == 404
    monkeypatch.setattr("ferry.send_file.PIECE", 1 << 20)
    (tmp_path / "g").write_bytes(os.urandom(3 << 20))
    upload_id = _session(model_server, 3 << 20)
    pieces: list[int] = []
    with pytest.raises(SendStopped):
        send_file(target, "PATCH", f"/api/uploads/{upload_id}", tmp_path / "g", 3 << 20,
                  Hasher(), timeout=30, on_sent=pieces.append, stopped=lambda: bool(pieces))
    assert pieces == [1 << 20]  # stopped between pieces; the server drops the cut body
    httpx.delete(f"{model_server}/api/uploads/{upload_id}")
    assert _temp_files(store) == []


def test_only_plain_http_without_a_proxy_takes_the_sendfile_path(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    target = plain_target("http://127.0.0.1:11434/base/")
    assert target is not None and (target.host, target.port, target.prefix) == (
        "127.0.0.1", 11434, "/base")
    assert plain_target("https://127.0.0.1:11434") is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert plain_target("http://10.1.2.3:11434") is None
    monkeypatch.setenv("NO_PROXY", "10.1.2.3")
    assert plain_target("http://10.1.2.3:11434") is not None


def test_cli_create_sends_the_weights_by_sendfile(model_server, settings, store: Store,
                                                  make_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_HOST", model_server.removeprefix("http://"))
    monkeypatch.setenv("FERRY_HOME", str(settings.home))
    calls: list[str] = []
    real = create_cmd.send_file
    monkeypatch.setattr(create_cmd, "send_file",
                        lambda target, method, path, *a, **k: calls.append(path)
                        or real(target, method, path, *a, **k))
    ckpt = make_checkpoint("llama")
    (tmp_path / "Modelfile").write_text(f"FROM {ckpt}\n")
    assert main(["create", "me/sent", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 0
    assert len(calls) == 1 and calls[0].startswith("/api/uploads/")
    digest = Digest.parse("sha256:" + hashlib.sha256((ckpt / SHARD).read_bytes()).hexdigest())
    deadline = time.monotonic() + 30  # stored once the create released it, off its path
    while not store.has_blob(digest) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.has_blob(digest)
    _sequential_create(model_server, store, ckpt, "me/seq", "int4")
    assert _manifest(store, "me/sent") == _manifest(store, "me/seq")
    assert _temp_files(store) == []
