"""Manifest parsing: strict validation, exact bytes, and the model config blob."""

from __future__ import annotations

import json

import pytest
from fixtures_ollama import go_json

from registry import media_types as mt
from registry.digests import Digest
from registry.errors import InvalidManifest, TooLarge
from registry.manifests import (
    Descriptor,
    ModelConfig,
    build_manifest,
    parse_manifest,
)

A, B, C = ("sha256:" + ch * 64 for ch in "abc")


def _doc(**changes):
    doc = {
        "schemaVersion": 2,
        "mediaType": mt.DOCKER_MANIFEST,
        "config": {"mediaType": mt.DOCKER_CONFIG, "digest": A, "size": 10},
        "layers": [
            {"mediaType": mt.TENSOR, "digest": B, "size": 100, "name": "model.norm.weight"},
            {"mediaType": mt.MODEL, "digest": C, "size": 5, "from": "sha256-parent"},
        ],
    }
    doc.update(changes)
    return doc


def test_an_ollama_manifest_parses_and_keeps_its_exact_bytes():
    raw = json.dumps(_doc(), indent=3).encode() + b"\n\n"
    manifest = parse_manifest(raw)
    assert manifest.raw == raw
    assert manifest.digest == Digest.of(raw)
    assert manifest.media_type == mt.DOCKER_MANIFEST
    assert manifest.total_size == 115
    assert manifest.blob_digests() == {Digest.parse(A), Digest.parse(B), Digest.parse(C)}
    tensor, model = manifest.layers
    assert tensor.name == "model.norm.weight" and model.from_ == "sha256-parent"
    assert manifest.layers_of(mt.MODEL) == [model]


def test_descriptors_round_trip_unknown_fields():
    data = {"mediaType": mt.JSON, "digest": A, "size": 3, "name": "config.json",
            "annotations": {"k": "v"}, "x-extra": [1, 2]}
    assert Descriptor.from_dict(data, "layer").to_dict() == data


def test_build_manifest_writes_what_go_json_encoder_writes():
    config = Descriptor(mt.DOCKER_CONFIG, Digest.parse(A), 10)
    layers = [Descriptor(mt.TENSOR, Digest.parse(B), 100, name="w")]
    raw = build_manifest(config, layers)
    assert raw == go_json(json.loads(raw))
    assert parse_manifest(raw).layers == tuple(layers)


def test_an_index_lists_its_children():
    index = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX,
             "manifests": [{"mediaType": mt.OCI_MANIFEST, "digest": A, "size": 7,
                            "platform": {"os": "linux"}}]}
    manifest = parse_manifest(json.dumps(index).encode())
    assert manifest.is_index and manifest.references()[0].platform == {"os": "linux"}
    assert manifest.blob_digests() == set()


def test_media_type_may_come_from_the_content_type_or_the_shape():
    doc = _doc()
    del doc["mediaType"]
    raw = json.dumps(doc).encode()
    assert parse_manifest(raw, mt.DOCKER_MANIFEST).media_type == mt.DOCKER_MANIFEST
    assert parse_manifest(raw).media_type == mt.OCI_MANIFEST


@pytest.mark.parametrize("doc, reason", [
    (_doc(schemaVersion=1), "schemaVersion must be 2, got 1"),
    (_doc(schemaVersion=True), "schemaVersion must be 2"),
    (_doc(mediaType="text/plain"), "unsupported manifest media type 'text/plain'"),
    (_doc(config={"mediaType": mt.DOCKER_CONFIG, "digest": "sha256:12", "size": 1}),
     "config.digest"),
    (_doc(config={"mediaType": mt.DOCKER_CONFIG, "digest": A, "size": -1}),
     "config.size must be a non-negative integer"),
    (_doc(config={"mediaType": mt.DOCKER_CONFIG, "digest": A, "size": 1.5}),
     "config.size must be a non-negative integer"),
    (_doc(config={"mediaType": mt.DOCKER_CONFIG, "digest": A, "size": "1"}),
     "config.size must be a non-negative integer"),
    (_doc(config={"digest": A, "size": 1}), "config.mediaType must be a non-empty string"),
    (_doc(layers=[{"mediaType": mt.TENSOR, "digest": A, "size": 1, "name": 5}]),
     "layers[0].name must be a string"),
    (_doc(layers=[{"mediaType": mt.TENSOR, "digest": "sha512:" + "a" * 128, "size": 1}]),
     "layers[0].digest"),
    (_doc(layers={"not": "a list"}), "layers must be a list"),
    (_doc(layers=["x"]), "layers[0] must be an object"),
    ({"schemaVersion": 2, "mediaType": mt.DOCKER_MANIFEST}, "config is required"),
    ({"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": {}},
     "manifests must be a list"),
    ([1, 2], "the top level must be a JSON object"),
])
def test_invalid_manifests_name_the_broken_field(doc, reason):
    with pytest.raises(InvalidManifest) as info:
        parse_manifest(json.dumps(doc).encode())
    assert reason in info.value.message


def test_bytes_that_are_not_json_are_invalid():
    with pytest.raises(InvalidManifest, match="not valid JSON"):
        parse_manifest(b"\xff\xfe{")


def test_a_content_type_that_contradicts_the_body_is_invalid():
    with pytest.raises(InvalidManifest, match="does not match mediaType"):
        parse_manifest(json.dumps(_doc()).encode(), mt.OCI_MANIFEST)


def test_manifests_over_the_size_limit_are_refused():
    raw = json.dumps(_doc(annotations={"pad": "x" * 5000})).encode()
    with pytest.raises(TooLarge):
        parse_manifest(raw, max_bytes=4096)
    assert parse_manifest(raw).annotations == {"pad": "x" * 5000}


def test_model_config_round_trips_known_and_unknown_fields():
    raw = json.dumps({
        "model_format": "safetensors", "model_family": "", "model_families": None,
        "file_type": "int4", "renderer": "qwen3.5", "parser": "qwen3.5", "requires": "0.19.0",
        "capabilities": ["completion", "tools"], "draft": {"tensor_prefix": "draft."},
        "rootfs": {"type": "layers"}, "context_length": 4096,
    }).encode()
    config = ModelConfig.from_json(raw)
    assert config.file_type == "int4" and config.capabilities == ["completion", "tools"]
    assert config.extra == {"rootfs": {"type": "layers"}}
    again = ModelConfig.from_json(config.to_json())
    assert again == config
    assert json.loads(config.to_json())["draft"] == {"tensor_prefix": "draft."}


@pytest.mark.parametrize("raw", [b"[1]", b"{bad", b"\xff"])
def test_model_config_rejects_non_objects(raw):
    with pytest.raises(InvalidManifest, match="config blob"):
        ModelConfig.from_json(raw)
