"""GGUF creates: wrapped as-is (digest unchanged), split GGUFs merged, metadata cached."""

from __future__ import annotations

import gguf
import httpx
import numpy as np

from registry import media_types as mt
from registry.digests import Digest

from .gguf_files import write_gguf
from .helpers import layer_path, read_model


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/api/create", json={"stream": False, **body}, timeout=60)


def test_gguf_is_wrapped_with_its_digest_and_metadata(model_server, store, tmp_path):
    digest = store.blob_writer().write_all(write_gguf(tmp_path / "m.gguf").read_bytes())
    resp = _post(model_server, {"model": "me/g", "files": {"m.gguf": str(digest)},
                                "system": "hi"})
    assert resp.json() == {"status": "success"}
    manifest, config = read_model(store, "me/g")
    assert manifest["layers"][0] == {"mediaType": mt.MODEL, "digest": str(digest),
                                     "size": store.blob_size(digest)}
    assert manifest["layers"][1]["mediaType"] == mt.SYSTEM
    assert config.model_format == "gguf" and config.model_family == "llama"
    assert config.file_type == "Q4_K_M" and config.context_length == 4096
    assert config.capabilities == ["completion", "tools"]
    document = store.read_metadata(digest)
    assert document is not None and document["kv"]["llama.block_count"] == 2
    assert sorted(document["omitted"]) == ["llama.test.inf_array", "llama.test.nan",
                                           "tokenizer.ggml.tokens"]
    httpx.request("DELETE", f"{model_server}/api/delete", json={"model": "me/g"})
    assert not store.metadata_path(digest).exists()


def test_gguf_detected_by_magic_without_extension(model_server, store, tmp_path):
    digest = store.blob_writer().write_all(write_gguf(tmp_path / "m.gguf").read_bytes())
    resp = _post(model_server, {"model": "me/g", "files": {"weights": str(digest)}})
    assert resp.status_code == 200
    manifest, _ = read_model(store, "me/g")
    assert manifest["layers"][0]["digest"] == str(digest)


def test_quantize_with_gguf_is_refused(model_server, store, tmp_path):
    digest = store.blob_writer().write_all(write_gguf(tmp_path / "m.gguf").read_bytes())
    resp = _post(model_server, {"model": "me/g", "files": {"m.gguf": str(digest)},
                                "quantize": "int4"})
    assert resp.status_code == 400
    assert "only supported for safetensors imports" in resp.json()["error"]
    assert not store.manifests_dir.exists() or not any(store.manifests_dir.rglob("me"))


def test_mixed_gguf_and_safetensors_is_refused(model_server, store, tmp_path):
    digest = str(store.blob_writer().write_all(write_gguf(tmp_path / "m.gguf").read_bytes()))
    resp = _post(model_server, {"model": "me/g", "files": {"m.gguf": digest,
                                                          "model.safetensors": digest}})
    assert resp.status_code == 400 and "mixed model file types" in resp.json()["error"]


def test_split_gguf_parts_are_merged_into_one_model_layer(model_server, store, tmp_path):
    write_gguf(tmp_path / "split" / "m.gguf", split_max_tensors=2, tensors=5)
    parts = sorted((tmp_path / "split").iterdir())
    assert len(parts) == 3
    files = {p.name: str(store.blob_writer().write_all(p.read_bytes())) for p in parts}
    assert _post(model_server, {"model": "me/split", "files": files}).status_code == 200
    manifest, config = read_model(store, "me/split")
    assert [x["mediaType"] for x in manifest["layers"]] == [mt.MODEL]
    merged = gguf.GGUFReader(layer_path(store, manifest["layers"][0]))
    assert not [k for k in merged.fields if k.startswith("split.")]
    assert merged.fields["llama.context_length"].contents() == 4096
    assert [t.name for t in merged.tensors] == [f"blk.{i}.weight" for i in range(5)]
    for i, tensor in enumerate(merged.tensors):
        assert np.array_equal(tensor.data, np.full((4, 8 + i), i, dtype=np.float32))
    assert config.model_type == str(sum(4 * (8 + i) for i in range(5)))
    digest = Digest.parse(manifest["layers"][0]["digest"])
    assert store.read_metadata(digest)["kv"]["general.architecture"] == "llama"


def test_split_gguf_with_a_missing_part_is_refused(model_server, store, tmp_path):
    write_gguf(tmp_path / "split" / "m.gguf", split_max_tensors=2, tensors=5)
    parts = sorted((tmp_path / "split").iterdir())[:2]
    files = {p.name: str(store.blob_writer().write_all(p.read_bytes())) for p in parts}
    resp = _post(model_server, {"model": "me/split", "files": files})
    assert resp.status_code == 400 and "needs parts 1..3" in resp.json()["error"]


def test_truncated_gguf_is_refused_with_400(model_server, store, tmp_path):
    raw = write_gguf(tmp_path / "m.gguf").read_bytes()
    digest = store.blob_writer().write_all(raw[:-40])
    resp = _post(model_server, {"model": "me/cut", "files": {"m.gguf": str(digest)}})
    assert resp.status_code == 400
    assert "truncated GGUF: tensor blk.2.weight runs past the end" in resp.json()["error"]
