"""POST /api/create against a real model server: success, every bad input, 503, cancellation."""

from __future__ import annotations

import json
import shutil
import struct
import time

import httpx
import pytest

from registry import media_types as mt
from registry.digests import Digest
from tests.conftest import serve_app
from tests.workflows.create.conftest import wide_checkpoint  # noqa: F401 (fixture)
from tests.workflows.create.helpers import read_model, stage_tree, upload_dir


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/create", json=body, timeout=120)


def _no_model(store, name: str = "me/bad") -> bool:
    manifests = [p for p in store.manifests_dir.rglob("*") if p.is_file()]
    return not manifests and not stage_tree(store)


def test_create_streams_progress_and_publishes_the_model(model_server, store, make_checkpoint):
    files = upload_dir(store, make_checkpoint("qwen3", shard_mb=1.0))
    with httpx.stream("POST", f"{model_server}/api/create", timeout=120,
                      json={"model": "me/q3:int4", "files": files, "quantize": "Q4"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in resp.iter_lines() if line]
    assert events[-1] == {"status": "success"}
    assert any(e.get("status", "").startswith("quantizing model.layers") for e in events)
    manifest, config = read_model(store, "me/q3:int4")
    assert config.file_type == "int4" and config.model_family == "qwen3"
    assert {x["name"] for x in manifest["layers"] if x["mediaType"] == mt.JSON} >= {"config.json"}
    assert not stage_tree(store)
    tags = httpx.get(f"{model_server}/api/tags").json()["models"]
    assert [m["name"] for m in tags] == ["me/q3:int4"]


def test_recreating_a_model_reuses_blobs_and_removes_unused_ones(model_server, store,
                                                                  make_checkpoint):
    files = upload_dir(store, make_checkpoint("llama"))
    assert _post(model_server, {"model": "me/t", "files": files, "quantize": "int8",
                                "stream": False}).json() == {"status": "success"}
    first, _ = read_model(store, "me/t")
    assert _post(model_server, {"model": "me/t", "files": files, "stream": False}
                 ).status_code == 200
    second, _ = read_model(store, "me/t")
    gone = {x["digest"] for x in first["layers"]} - {x["digest"] for x in second["layers"]}
    assert gone and not any(store.has_blob(Digest.parse(d)) for d in gone)


def _truncated(ckpt, tmp_path):
    out = tmp_path / "trunc"
    shutil.copytree(ckpt, out)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:-100])
    return out


def _overlapping(ckpt, tmp_path):
    out = tmp_path / "overlap"
    shutil.copytree(ckpt, out)
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length:])
    return out


def _config_edit(name: str, **changes):
    def make(ckpt, tmp_path):
        out = tmp_path / name
        shutil.copytree(ckpt, out)
        config = json.loads((out / "config.json").read_text())
        config.update(changes)
        (out / "config.json").write_text(json.dumps(config))
        return out
    return make


@pytest.mark.parametrize("variant,message", [
    (_truncated, "truncated"),
    (_overlapping, "overlap"),
    (_config_edit("arch", architectures=["MambaForCausalLM"]), "unsupported architecture"),
    (_config_edit("shape", hidden_size=256), "has shape"),
])
def test_bad_checkpoints_are_refused_with_400(model_server, store, make_checkpoint, tmp_path,
                                              variant, message):
    files = upload_dir(store, variant(make_checkpoint("llama"), tmp_path))
    resp = _post(model_server, {"model": "me/bad", "files": files, "quantize": "int4"})
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["error"]
    assert _no_model(store)


def test_missing_shard_is_refused(model_server, store, make_checkpoint):
    ckpt = make_checkpoint("qwen3", shard_mb=1.0)
    files = upload_dir(store, ckpt, skip=("model-00002-of-00003.safetensors",))
    resp = _post(model_server, {"model": "me/bad", "files": files})
    assert resp.status_code == 400
    assert "model-00002-of-00003.safetensors" in resp.json()["error"]
    assert "missing" in resp.json()["error"]
    assert _no_model(store)


@pytest.mark.parametrize("mutate,message", [
    (lambda f: {"../config.json": f["config.json"], **f}, "invalid path"),
    (lambda f: {"a\\b.json": f["config.json"], **f}, "invalid path"),
    (lambda f: {"c:x.json": f["config.json"], **f}, "invalid path"),
    (lambda f: {**f, **{f"x/{i}.json": f["config.json"] for i in range(1025)}}, "at most 1024"),
    (lambda f: {**f, "extra.json": "sha256:" + "0" * 64}, "missing"),
    (lambda f: {**f, "extra.json": "md5:abc"}, "invalid digest"),
])
def test_bad_files_maps_are_refused(model_server, store, make_checkpoint, mutate, message):
    files = mutate(upload_dir(store, make_checkpoint("llama")))
    resp = _post(model_server, {"model": "me/bad", "files": files})
    assert resp.status_code == 400
    assert message in resp.json()["error"]
    assert _no_model(store)


@pytest.mark.parametrize("extra,message", [
    ({"quantize": "q3"}, "unsupported quantize type 'q3'"),
    ({"draft_quantize": "int4"}, "requires a DRAFT"),
    ({"requires": "0.1.0"}, "lower than the minimum"),
    ({"model": "bad//name"}, "invalid model name"),
])
def test_bad_options_are_refused(model_server, store, make_checkpoint, extra, message):
    files = upload_dir(store, make_checkpoint("llama"))
    resp = _post(model_server, {"model": "me/bad", "files": files, **extra})
    assert resp.status_code == 400
    assert message in resp.json()["error"]
    assert _no_model(store)


def test_oversized_metadata_file_is_refused(settings, make_checkpoint):
    from ferry.app import build_model_server
    from registry.store import Store

    small = settings.with_(max_metadata_file_bytes=100)
    store = Store(small.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    files = upload_dir(store, make_checkpoint("llama"))
    with serve_app(build_model_server(small)) as url:
        resp = _post(url, {"model": "me/bad", "files": files})
    assert resp.status_code == 400 and "config.json" in resp.json()["error"]
    assert "limit is 100" in resp.json()["error"]


def test_missing_mlx_is_503(model_server, store, make_checkpoint, monkeypatch):
    from runner.quant import QuantRuntimeUnavailable
    from server import create_api

    def unavailable():
        raise QuantRuntimeUnavailable("MLX is not available on this server (test)")

    monkeypatch.setattr(create_api, "load_mlx", unavailable)
    files = upload_dir(store, make_checkpoint("llama"))
    resp = _post(model_server, {"model": "me/bad", "files": files, "quantize": "int4"})
    assert resp.status_code == 503 and "MLX is not available" in resp.json()["error"]
    assert _no_model(store)


def test_client_disconnect_cancels_create(model_server, store, wide_checkpoint):
    files = upload_dir(store, wide_checkpoint)
    body = {"model": "me/wide", "files": files, "quantize": "nvfp4"}
    with httpx.stream("POST", f"{model_server}/api/create", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if json.loads(line).get("status", "").startswith("quantizing"):
                break  # leave mid-create: closing the response drops the connection
    deadline = time.monotonic() + 120
    while stage_tree(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stage_tree(store), "the worker did not stop"
    assert _no_model(store, "me/wide")
    assert not list(store.blobs_dir.glob(".tmp-*"))
    uploaded = {Digest.parse(d).filename for d in files.values()}
    written = [p for p in store.blobs_dir.iterdir() if p.name not in uploaded]
    assert len(written) < 2 * 9 + 3  # stopped before the last of the 21 tensors


def test_info_overrides_config_fields(model_server, store, make_checkpoint):
    files = upload_dir(store, make_checkpoint("llama"))
    info = {"capabilities": ["completion", "tools"], "parameter_size": "1M",
            "context_length": 1024, "base_name": "tiny"}
    resp = _post(model_server, {"model": "me/i", "files": files, "info": info,
                                "stream": False})
    assert resp.status_code == 200, resp.text
    _, config = read_model(store, "me/i")
    assert config.capabilities == ["completion", "tools"] and config.model_type == "1M"
    assert config.context_length == 1024 and config.extra["base_name"] == "tiny"


@pytest.mark.parametrize("info", [{"capabilities": "tools"}, {"context_length": -1},
                                  {"model_family": 3}, {"unknown": 1}, []])
def test_bad_info_is_refused(model_server, store, make_checkpoint, info):
    files = upload_dir(store, make_checkpoint("llama"))
    resp = _post(model_server, {"model": "me/bad", "files": files, "info": info})
    assert resp.status_code == 400 and "info" in resp.json()["error"]
    assert _no_model(store)


def test_quantize_with_an_existing_base_model_is_refused(model_server, store, make_checkpoint):
    files = upload_dir(store, make_checkpoint("llama"))
    assert _post(model_server, {"model": "me/base", "files": files, "stream": False}
                 ).status_code == 200
    resp = _post(model_server, {"model": "me/bad", "from": "me/base", "quantize": "int4"})
    assert resp.status_code == 400 and "not requantized" in resp.json()["error"]
    resp = _post(model_server, {"model": "me/bad", "from": "me/base", "files": files})
    assert resp.status_code == 400 and "cannot be combined" in resp.json()["error"]


def test_official_ollama_client_creates_a_model(model_server, store, make_checkpoint):
    import ollama

    client = ollama.Client(host=model_server)
    files = upload_dir(store, make_checkpoint("llama"))
    events = list(client.create(model="me/oc", files=files, quantize="int8",
                                system="hi", stream=True))
    assert events[-1].status == "success"
    _, config = read_model(store, "me/oc")
    assert config.file_type == "int8"
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="me/bad", files=files, quantize="int3")
    assert err.value.status_code == 400
