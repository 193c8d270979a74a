"""The pieces behind show: safetensors headers, Modelfile rendering, GGUF metadata, numbers."""

from __future__ import annotations

import struct

import httpx
import pytest
from fixtures_ollama import OllamaModelsDir, safetensors_blob

from registry.errors import InvalidManifest
from registry.model_info import GGUFKV, human_number
from registry.model_show import show_model
from registry.modelfile import ModelfileParts, go_syntax, go_value, quote, render_modelfile
from registry.names import Name
from registry.safetensors_header import logical_tensors, read_header
from registry.store import Store


@pytest.mark.parametrize("data, reason", [
    (b"\x01\x02", "too short"),
    (struct.pack("<Q", 2**40), "header"),
    (struct.pack("<Q", 100) + b"{}", "truncated"),
    (struct.pack("<Q", 4) + b"{no}", "not JSON"),
    (struct.pack("<Q", 2) + b"[]", "must be a JSON object"),
])
def test_broken_safetensors_headers_are_named(tmp_path, data, reason):
    path = tmp_path / "sha256-x"
    path.write_bytes(data)
    with pytest.raises(InvalidManifest, match=reason):
        read_header(path)


def test_show_of_a_model_with_a_corrupt_tensor_blob_is_a_400_naming_it(settings, model_server):
    models = OllamaModelsDir(settings.models_dir)
    bad = models.layer("tensor", b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", name="w")
    models.manifest("bad:latest", {"model_format": "safetensors"}, [bad])
    response = httpx.post(f"{model_server}/api/show", json={"model": "bad"})
    assert response.status_code == 400
    assert bad["digest"].replace(":", "-") in response.json()["error"]


def test_packed_shapes_unpack_from_bits_when_the_group_size_is_absent(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(safetensors_blob(
        {"w": ("U32", [8, 16]), "w.scale": ("BF16", [8, 2]), "norm": ("F32", [8])},
        metadata={"w.quant_type": "int8"},
    ))
    tensors = {t.name: (t.type, t.shape) for t in logical_tensors(read_header(path))}
    assert tensors == {"w": ("INT8", (8, 64)), "norm": ("F32", (8,))}


def test_a_plain_bias_tensor_is_not_taken_for_a_quantization_companion(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(safetensors_blob({"q.weight": ("BF16", [4, 4]), "q.bias": ("BF16", [4])}))
    assert [t.name for t in logical_tensors(read_header(path))] == ["q.weight", "q.bias"]


@pytest.mark.parametrize("text, quoted", [
    ("plain", "plain"),
    ("two\nlines", '"two\nlines"'),
    (' padded', '" padded"'),
    ('say "hi"\nthen', '"""say "hi"\nthen"""'),
])
def test_modelfile_values_are_quoted_like_ollama(text, quoted):
    assert quote(text) == quoted


@pytest.mark.parametrize("value, plain, syntax", [
    (1.0, "1", "1"), (0.7, "0.7", "0.7"), (True, "true", "true"), (42, "42", "42"),
    ("stop", "stop", '"stop"'), ("é\n", "é\n", '"é\\n"'),
])
def test_parameter_values_print_like_go(value, plain, syntax):
    assert go_value(value) == plain
    assert go_syntax(value) == syntax


def test_modelfile_orders_commands_like_ollama():
    parts = ModelfileParts(source="/m/blobs/sha256-a", short_name="x:latest",
                           adapters=["/m/blobs/sha256-b"], template="{{ .Prompt }}",
                           system="sys", parameters={"top_k": 40, "stop": ["a", "b"]},
                           licenses=["L1", "L2"],
                           messages=[{"role": "user", "content": "hi there"}])
    body = render_modelfile(parts).split("\n\n", 1)[1]
    assert body.splitlines() == [
        "FROM /m/blobs/sha256-a", "ADAPTER /m/blobs/sha256-b", "TEMPLATE {{ .Prompt }}",
        "SYSTEM sys", "PARAMETER stop a", "PARAMETER stop b", "PARAMETER top_k 40",
        "LICENSE L1", "LICENSE L2", "MESSAGE user hi there",
    ]


@pytest.mark.parametrize("count, text", [
    (950, "950"), (1_000, "1K"), (1_500, "2K"), (3_072, "3K"), (7_000_000_000, "7B"),
    (8_030_261_248, "8.0B"), (2_850_000_000, "2.9B"), (751_632_384, "751.63M"),
    (500_500_000, "500.50M"), (125_000_000, "125M"),
])
def test_human_number_matches_ollama(count, text):
    assert human_number(count) == text


def test_a_foreign_metadata_file_is_ignored(settings):
    assert GGUFKV.from_metadata({"something": "else"}) is None
    assert GGUFKV.from_metadata(None) is None
    models = OllamaModelsDir(settings.models_dir)
    weights = models.layer("model", b"GGUF foreign")
    models.manifest("f:latest", {"model_format": "gguf", "model_family": "gemma"}, [weights])
    (settings.models_dir / "metadata").mkdir()
    path = settings.models_dir / "metadata" / (weights["digest"].replace(":", "-") + ".json")
    path.write_text('{"not": "ours"}')
    body = show_model(Store(settings.models_dir), Name.parse_valid("f"))
    assert body["model_info"] == {} and body["details"]["family"] == "gemma"
    assert body["capabilities"] == ["completion"]
