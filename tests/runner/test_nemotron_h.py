"""Nemotron-H against mlx-lm's `nemotron_h` on random-weight checkpoints (float32 logits and
greedy tokens, prompts longer than a prefill chunk), create's validation and quantisation of its
layout, and the whole path: create -> model server -> runner -> /api/generate."""

from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path

import httpx
import mlx.core as mx
import mlx_lm
import pytest
from conftest import serve_app
from mlx_lm.generate import generate_step
from nemotron_fixture import write_nemotron_checkpoint

from registry.names import Name
from registry.safetensors_header import read_header
from registry.store import Store
from runner.generate import Generator
from runner.load import build_model, load_model
from runner.nn import ssm
from runner.quant import parse_quant_type
from runner.sample import Options
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create
from workflows.create.errors import CreateError

PROMPT = [random.Random(3).randrange(5, 2048) for _ in range(300)]  # > 2 scan chunks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, make_checkpoint) -> Path:
    return write_nemotron_checkpoint(tmp_path_factory.mktemp("nemotron"), make_checkpoint())


@pytest.fixture(scope="module")
def store(tmp_path_factory, checkpoint) -> Store:
    store = Store(tmp_path_factory.mktemp("nemotron-store"))
    for name, quant in (("t/nemotron", None), ("t/nemotron-int4", "int4")):
        options = CreateOptions(quantize=parse_quant_type(quant) if quant else None)
        create(Name.parse(name), checkpoint, options, store, lambda event: None,
               threading.Event())
    return store


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, _ = mlx_lm.load(str(checkpoint))
    model.set_dtype(mx.float32)
    return model


def _generator(loaded, chunk: int) -> Generator:
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: let num_predict decide the length
    return Generator(loaded.model, tokenizer, loaded.context_length, prefill_chunk=chunk)


def test_float32_logits_match_mlx_lm_across_prefill_chunks(store, reference):
    loaded = load_model(store, "t/nemotron", "float32")
    expected = reference(mx.array([PROMPT]))
    whole = loaded.model(mx.array([PROMPT]))
    assert mx.abs(whole - expected).max().item() <= 1e-3
    caches = loaded.model.make_cache()
    pieces = [loaded.model(mx.array([PROMPT[i:i + 77]]), caches) for i in range(0, 300, 77)]
    chunked = mx.concatenate(pieces, axis=1)  # chunk ends at 77, 154, 231: none at a scan edge
    assert mx.abs(chunked - expected).max().item() <= 1e-3


def test_greedy_tokens_identical_to_mlx_lm(store, reference):
    loaded = load_model(store, "t/nemotron", "float32")
    generator = _generator(loaded, chunk=64)  # five prefill chunks; mlx-lm prefills in one
    pieces = list(generator.generate(PROMPT, Options(temperature=0, num_predict=32)))
    assert pieces[-1].eval_count == 32
    expected = [int(t) for t, _ in generate_step(mx.array(PROMPT), reference, max_tokens=32)]
    assert generator.tokens == expected


@pytest.mark.parametrize("name", ["t/nemotron", "t/nemotron-int4"])
def test_auto_compute_loads_and_decodes_as_float32_does(store, name):
    """What a runner loads by default: the fused path (bf16 kernel, int4 kernel) for this
    bf16 checkpoint, with greedy tokens identical to the float32 path's."""
    fused = load_model(store, name, "auto")
    assert fused.compute == "fused"
    options = Options(temperature=0, num_predict=16)
    generator = _generator(fused, chunk=64)
    list(generator.generate(PROMPT[:100], options))
    reference = _generator(load_model(store, name, "float32"), chunk=64)
    list(reference.generate(PROMPT[:100], options))
    assert generator.tokens == reference.tokens


def test_biases_and_older_config_names_match_mlx_lm(tmp_path, make_checkpoint):
    biased = write_nemotron_checkpoint(tmp_path / "biased", make_checkpoint(), seed=5,
                                       mamba_proj_bias=True, attention_bias=True, mlp_bias=True,
                                       hybrid_override_pattern="M*-")
    reference, _ = mlx_lm.load(str(biased))
    reference.set_dtype(mx.float32)
    config = json.loads((biased / "config.json").read_text())
    del config["mamba_proj_bias"]  # older configs: use_bias, attention_head_dim
    config["use_bias"], config["attention_head_dim"] = True, config.pop("head_dim")
    model, module = build_model(config)
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(biased / "model.safetensors"))
               .items()}
    assert "backbone.layers.0.mixer.in_proj.bias" in weights
    model.load_weights(list(module.sanitize(weights).items()), strict=True)
    tokens = mx.array([PROMPT[:40]])
    assert mx.abs(model(tokens) - reference(tokens)).max().item() <= 1e-3


def test_scan_and_single_step_recurrence_agree():
    rng = mx.random.key(0)
    k1, k2, k3, k4 = mx.random.split(rng, 4)
    x = mx.random.normal((1, 40, 4, 8), key=k1)
    dt = mx.random.uniform(0.01, 0.2, (1, 40, 4), key=k2)
    b, c = mx.random.normal((1, 40, 2, 6), key=k3), mx.random.normal((1, 40, 2, 6), key=k4)
    log_a = -mx.array([0.5, 1.0, 2.0, 4.0])
    scanned, end = ssm.scan(x, dt, log_a, b, c, None, chunk=16)
    state, steps = None, []
    for t in range(40):
        y, state = ssm.step(x[:, t:t + 1], dt[:, t:t + 1], log_a, b[:, t:t + 1],
                            c[:, t:t + 1], state)
        steps.append(y)
    assert mx.allclose(mx.concatenate(steps, axis=1), scanned, atol=1e-4).item()
    assert mx.allclose(state, end, atol=1e-4).item()


def test_int4_create_keeps_conv_and_ssm_parameters_at_source_precision(store):
    manifest = store.get_model(Name.parse_valid("t/nemotron-int4")).manifest()
    dtypes = {}
    for layer in manifest.layers:
        if layer.name and layer.name.startswith("backbone.layers.0.mixer"):
            header = read_header(store.blob_path(layer.digest))
            dtypes[layer.name] = {k: v["dtype"] for k, v in header.items()
                                  if k != "__metadata__"}
    kept = ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight")
    for suffix in kept:
        assert dtypes[f"backbone.layers.0.mixer.{suffix}"] == {
            f"backbone.layers.0.mixer.{suffix}": "BF16"}
    in_proj = dtypes["backbone.layers.0.mixer.in_proj.weight"]
    assert in_proj["backbone.layers.0.mixer.in_proj.weight"] == "U32"  # packed int4


def test_int4_model_runs_close_to_float32(store):
    full = load_model(store, "t/nemotron", "float32").model(mx.array([PROMPT[:64]]))
    native = load_model(store, "t/nemotron-int4", "native")
    assert native.model.backbone.layers[0].mixer.A_log.dtype == mx.bfloat16
    quant = native.model(mx.array([PROMPT[:64]])).astype(mx.float32)
    cos = mx.sum(full * quant, -1) / (mx.linalg.norm(full, axis=-1)
                                      * mx.linalg.norm(quant, axis=-1))
    assert cos.min().item() >= 0.9


def test_create_rejects_a_conv1d_of_the_wrong_shape(tmp_path, checkpoint):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    config["conv_kernel"] = 3  # the stored conv1d has 4 taps
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CreateError, match=r"conv1d\.weight"):
        create(Name.parse("t/bad"), bad, CreateOptions(), Store(tmp_path / "s"),
               lambda event: None, threading.Event())


def test_api_generate_runs_a_created_nemotron_model(tmp_path, checkpoint):
    from ferry.app import build_model_server
    from ferry.config import Settings

    settings = Settings.from_env({"FERRY_HOME": str(tmp_path), "FERRY_COMPUTE": "float32"})
    store = Store(settings.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse("me/nemotron"), checkpoint, CreateOptions(), store, lambda event: None,
           threading.Event())
    with serve_app(build_model_server(settings)) as url:
        body = {"model": "me/nemotron", "prompt": "hello there", "stream": False,
                "options": {"temperature": 0, "num_predict": 6}}
        first = httpx.post(f"{url}/api/generate", json=body, timeout=120).json()
        again = httpx.post(f"{url}/api/generate", json=body, timeout=120).json()
        httpx.post(f"{url}/api/generate", json={"model": "me/nemotron", "keep_alive": 0},
                   timeout=30)
    assert first["done"] and first["eval_count"] > 0, first
    assert again["response"] == first["response"]
    assert again["prompt_eval_count"] == first["prompt_eval_count"]  # the whole prompt
    assert again["prompt_cached_count"] > first.get("prompt_cached_count", 0)  # from the trie


def test_decode_graph_matches_mlx_lm_token_by_token_across_a_kv_buffer_growth(store, reference):
    from mlx_lm.models.cache import make_prompt_cache

    model = load_model(store, "t/nemotron", "float32").model
    prompt = mx.array([PROMPT[:250]])
    ours, theirs = model.make_cache(), make_prompt_cache(reference)
    logits, expected = model(prompt, ours), reference(prompt, cache=theirs)
    for _ in range(12):  # positions 250..261: the KV buffers grow at 256
        token = mx.argmax(expected[:, -1:], axis=-1)
        logits, expected = model(token, ours), reference(token, cache=theirs)
        assert mx.abs(logits - expected).max().item() <= 1e-3
    assert model.graph_tokens == 12  # every step took the compiled whole-model graph
    assert ours[1].offset == 262 and ours[1].capacity == 512


def test_decode_graph_on_a_quantized_bf16_model_is_as_close_to_float32_as_layer_by_layer(store):
    """Native compute: int4 matmuls, bf16 activations. Both decode paths round differently, so
    each is measured against the same weights computed in float32."""
    from runner.models import nemotron_h

    graph = load_model(store, "t/nemotron-int4", "native").model
    layered = load_model(store, "t/nemotron-int4", "native").model
    layered._traceable = False  # as a model with a host-computed layer decodes
    exact = load_model(store, "t/nemotron-int4", "float32").model
    models = (graph, layered, exact)
    caches = [m.make_cache() for m in models]
    tokens, errors = mx.array([PROMPT[:40]]), {"graph": 0.0, "layered": 0.0}
    for _ in range(8):
        a, b, c = (m(tokens, cache) for m, cache in zip(models, caches, strict=True))
        errors["graph"] += mx.abs(a.astype(mx.float32) - c).max().item()
        errors["layered"] += mx.abs(b.astype(mx.float32) - c).max().item()
        tokens = mx.argmax(c[:, -1:], axis=-1)
    assert graph.graph_tokens == 7 and layered.graph_tokens == 0
    assert errors["graph"] <= 1.5 * errors["layered"] + 1e-3, errors
    assert nemotron_h.traceable(graph) and not nemotron_h.traceable(
        nemotron_h.nn.Sequential(nemotron_h.nn.Linear(2, 2)))
