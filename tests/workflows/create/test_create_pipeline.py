"""create() on fixture checkpoints: layers, quantized blobs, config blob, drafts, cancellation."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from registry import media_types as mt
from registry.names import Name
from runner.quant import QuantType, dequantize, parse_quant_type
from workflows.create import CreateOptions, create
from workflows.create.errors import CreateCancelled
from workflows.create.inventory import take_inventory
from workflows.create.plan import plan_model

from .helpers import layer_path, read_model

# Max |dequantized - source| relative to the largest |source| of its quantization group: the
# formats' own loss (affine keeps zero exact, so up to one step of range/(2^bits - 1); the fp4
# formats round to e2m1, whose top gap 4..6 is a third of the range) plus scale rounding.
# Measured on these fixtures: int4 0.130, int8 0.017, nvfp4 0.329, mxfp4 0.200, mxfp8 0.059.
# A wrong scale, bias, group size or tensor gives errors near 1 or more.
ERROR_BOUNDS = {"int4": 0.14, "int8": 0.02, "nvfp4": 0.35, "mxfp4": 0.22, "mxfp8": 0.065}


def group_error(restored: mx.array, source: mx.array, group_size: int) -> float:
    """max over groups of max|restored - source| / max|source| within the group."""
    shape = (*source.shape[:-1], source.shape[-1] // group_size, group_size)
    diff = mx.abs(restored - source).reshape(shape).max(axis=-1)
    scale = mx.maximum(mx.abs(source).reshape(shape).max(axis=-1), 1e-12)
    return (diff / scale).max().item()


def _create(store, ckpt, quant: str | None, name: str = "me/tiny", **options) -> None:
    opts = CreateOptions(quantize=parse_quant_type(quant) if quant else None, **options)
    create(Name.parse(name), ckpt, opts, store, lambda event: None, threading.Event())


def _source_tensors(ckpt) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        out.update(mx.load(str(path)))
    return out


def _load_blob(store, layer) -> tuple[dict[str, mx.array], dict[str, str]]:
    return mx.load(str(layer_path(store, layer)), format="safetensors", return_metadata=True)


@pytest.mark.parametrize("quant", ["int4", "int8", "nvfp4", "mxfp4", "mxfp8"])
def test_each_quant_type_dequantizes_close_to_the_source(store, make_checkpoint, quant):
    ckpt = make_checkpoint("llama")
    _create(store, ckpt, quant)
    manifest, config = read_model(store, "me/tiny")
    assert config.file_type == quant
    source = _source_tensors(ckpt)
    quantized = 0
    for layer in manifest["layers"]:
        if layer["mediaType"] != mt.TENSOR:
            continue
        name = layer["name"]
        arrays, metadata = _load_blob(store, layer)
        qtype = QuantType.from_metadata(metadata)
        if qtype is None:
            assert set(arrays) == {name}
            assert mx.array_equal(arrays[name], source[name]).item(), name
            continue
        quantized += 1
        assert arrays[name].dtype == mx.uint32
        assert (f"{name}.bias" in arrays) == qtype.has_bias
        restored = dequantize(arrays[name], arrays[f"{name}.scale"],
                              arrays.get(f"{name}.bias"), qtype).astype(mx.float32)
        error = group_error(restored, source[name].astype(mx.float32), qtype.group_size)
        assert error < ERROR_BOUNDS[qtype.name], (name, qtype.name, error)
    assert quantized == 4 * 7 + 1  # every projection of 4 layers, plus lm_head


def test_int4_promotes_lm_head_and_kv_down_projections_to_int8(store, make_checkpoint):
    _create(store, make_checkpoint("llama"), "int4")
    manifest, _ = read_model(store, "me/tiny")
    types = {}
    for layer in manifest["layers"]:
        if layer["mediaType"] == mt.TENSOR:
            _, metadata = _load_blob(store, layer)
            types[layer["name"]] = (metadata or {}).get("quant_type")
    assert types["lm_head.weight"] == "int8"
    assert types["model.layers.0.self_attn.k_proj.weight"] == "int8"
    assert types["model.layers.0.self_attn.v_proj.weight"] == "int8"
    assert types["model.layers.0.mlp.down_proj.weight"] == "int8"
    assert types["model.layers.0.self_attn.q_proj.weight"] == "int4"
    assert types["model.layers.0.mlp.gate_proj.weight"] == "int4"
    assert types["model.embed_tokens.weight"] is None
    assert types["model.layers.0.input_layernorm.weight"] is None


@pytest.mark.parametrize("arch,shard_mb", [("llama", None), ("llama", 1.0), ("qwen3", None),
                                           ("qwen3", 1.0)])
def test_manifest_has_one_tensor_layer_per_tensor_and_json_layers(store, make_checkpoint, arch,
                                                                  shard_mb):
    ckpt = make_checkpoint(arch, shard_mb=shard_mb)
    _create(store, ckpt, "int8", template="{{ .Prompt }}", system="be brief",
            parameters={"temperature": 0.5}, license=("MIT",))
    manifest, config = read_model(store, "me/tiny")
    source = _source_tensors(ckpt)
    tensors = [x["name"] for x in manifest["layers"] if x["mediaType"] == mt.TENSOR]
    assert sorted(tensors) == sorted(source)
    jsons = {x["name"] for x in manifest["layers"] if x["mediaType"] == mt.JSON}
    expected = {"config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json"}
    assert jsons == expected  # the shard index is not a layer
    kinds = [x["mediaType"] for x in manifest["layers"][-4:]]
    assert kinds == [mt.TEMPLATE, mt.SYSTEM, mt.PARAMS, mt.LICENSE]
    assert manifest["config"]["mediaType"] == mt.DOCKER_CONFIG
    assert config.model_format == "safetensors"
    assert config.model_family == arch
    assert "completion" in (config.capabilities or [])
    assert config.architecture == take_inventory(ckpt).architecture


def test_unquantized_import_keeps_source_dtype_and_reports_it(store, make_checkpoint):
    _create(store, make_checkpoint("qwen3"), None)
    manifest, config = read_model(store, "me/tiny")
    assert config.file_type == "BF16"
    assert config.model_type.endswith("M")
    for layer in manifest["layers"]:
        if layer["mediaType"] == mt.TENSOR:
            arrays, metadata = _load_blob(store, layer)
            assert not metadata and arrays[layer["name"]].dtype == mx.bfloat16


def test_draft_layers_are_prefixed_and_appended(store, make_checkpoint):
    target, draft = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    _create(store, target, "int4", draft_dir=draft)
    manifest, config = read_model(store, "me/tiny")
    names = [x.get("name", "") for x in manifest["layers"]]
    drafts = [n for n in names if n.startswith(("draft.", "draft/"))]
    first_draft = names.index(drafts[0])
    assert all(n.startswith(("draft.", "draft/")) for n in names[first_draft:] if n)
    assert "draft.lm_head.weight" in drafts and "draft/config.json" in drafts
    assert config.draft == {"model_format": "safetensors", "architecture": "LlamaForCausalLM",
                            "tensor_prefix": "draft.", "config": "draft/config.json"}
    by_name = {x.get("name"): x for x in manifest["layers"]}
    _, head_meta = _load_blob(store, by_name["draft.lm_head.weight"])
    _, embed_meta = _load_blob(store, by_name["draft.model.embed_tokens.weight"])
    assert head_meta["quant_type"] == "int4"  # drafts get the requested type, no promotion
    assert embed_meta["quant_type"] == "int4"


def test_cancel_mid_create_publishes_nothing(store, make_checkpoint):
    cancel = threading.Event()
    seen = []

    def progress(event):
        seen.append(event)
        if event.get("completed"):
            cancel.set()  # after the first tensor blob

    opts = CreateOptions(quantize=parse_quant_type("int4"))
    ckpt = make_checkpoint("llama")
    with pytest.raises(CreateCancelled):
        create(Name.parse("me/tiny"), ckpt, opts, store, progress, cancel)
    assert not [p for p in store.manifests_dir.rglob("*") if p.is_file()]
    assert sum(1 for e in seen if e.get("completed")) == 1
    # One tensor blob, and the JSON files' blobs (written first); no temp file.
    blobs = list(store.blobs_dir.iterdir())
    assert len(blobs) == 1 + len(take_inventory(ckpt).json_files)
    assert not [b for b in blobs if b.name.startswith(".tmp-")]


def test_plan_is_pure_and_follows_the_policy(make_checkpoint):
    inv = take_inventory(make_checkpoint("qwen3"))
    plan = plan_model(inv, parse_quant_type("mxfp4"))
    quant = {b.name: b.tensors[0].quant for b in plan.blobs}
    assert quant["model.layers.0.self_attn.q_norm.weight"] is None
    assert quant["model.embed_tokens.weight"] is None  # tied embeddings stay at source
    assert quant["model.layers.0.self_attn.k_proj.weight"].name == "mxfp8"
    assert quant["model.layers.0.mlp.up_proj.weight"].name == "mxfp4"
    assert plan.parameter_count == sum(t.elements for t in inv.tensors.values())


@pytest.mark.parametrize("dtype,tag", [("float16", mx.float16), ("float32", mx.float32)])
def test_float16_and_float32_sources_keep_their_dtype_in_scales(store, make_checkpoint, dtype,
                                                                 tag):
    ckpt = make_checkpoint("llama", dtype=dtype)
    _create(store, ckpt, "int4")
    manifest, _ = read_model(store, "me/tiny")
    by_name = {x.get("name"): x for x in manifest["layers"]}
    name = "model.layers.1.self_attn.q_proj.weight"
    arrays, metadata = _load_blob(store, by_name[name])
    qtype = QuantType.from_metadata(metadata)
    assert qtype is not None and arrays[f"{name}.scale"].dtype == tag
    restored = dequantize(arrays[name], arrays[f"{name}.scale"], arrays[f"{name}.bias"], qtype)
    source = _source_tensors(ckpt)[name].astype(mx.float32)
    assert group_error(restored.astype(mx.float32), source, 64) < ERROR_BOUNDS["int4"]
    norm, _ = _load_blob(store, by_name["model.norm.weight"])
    assert norm["model.norm.weight"].dtype == tag


def test_uploaded_json_files_are_named_by_their_blobs_not_written_again(store, make_checkpoint,
                                                                        monkeypatch):
    """Same manifest as from the dir, but no JSON file is hashed, written or fsynced again."""
    import workflows.create as create_module
    from registry.digests import Digest
    from workflows.create import UploadedFiles

    from .helpers import upload_dir

    ckpt = make_checkpoint("llama")
    opts = CreateOptions(quantize=parse_quant_type("int4"))
    create(Name.parse("me/from-dir"), ckpt, opts, store, lambda e: None, threading.Event())
    files = {k: Digest.parse(v) for k, v in upload_dir(store, ckpt).items()}

    def rewritten(*args, **kwargs):
        raise AssertionError("an uploaded JSON file was written again")

    monkeypatch.setattr(create_module, "write_file_layer", rewritten)
    create(Name.parse("me/uploaded"), UploadedFiles(files), opts, store, lambda e: None,
           threading.Event())
    assert store.read_manifest(Name.parse("me/uploaded")) == \
        store.read_manifest(Name.parse("me/from-dir"))
