"""ferry's runner against mlx-lm on the same fixture checkpoints: logits, greedy decode,
quantized types, RoPE scaling."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import mlx_models
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.rope_utils import initialize_rope

from runner.generate import Generator
from runner.load import load_model
from runner.nn.rope import RoPE
from runner.sample import Options
from runner.tokenizer import ModelTokenizer

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures

PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]


def _reference(make_checkpoint, arch: str):
    model, _ = mlx_lm.load(str(make_checkpoint(arch)))
    model.set_dtype(mx.float32)
    return model


def _cosine_min(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    cos = mx.sum(a * b, -1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
    return cos.min().item()


@pytest.mark.parametrize("compute", ["float32", "fused"])  # fused: bf16 weights, bf16 kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_logits_match_mlx_lm(model_store, created_model, make_checkpoint, arch, compute):
    loaded = load_model(model_store, created_model(arch), compute)
    assert loaded.compute == compute
    tokens = mx.array([PROMPT])
    ours = loaded.model(tokens)
    reference = _reference(make_checkpoint, arch)(tokens)
    assert ours.dtype == mx.float32
    assert mx.abs(ours - reference).max().item() <= 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_64_tokens_identical_to_mlx_lm_in_float32(model_store, created_model,
                                                         make_checkpoint, arch):
    loaded = load_model(model_store, created_model(arch), "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: compare all 64, never stop early
    pieces = list(Generator(loaded.model, tokenizer, loaded.context_length).generate(
        PROMPT, Options(temperature=0, num_predict=64)))
    done = pieces.pop()
    assert done.eval_count == 64
    reference = _reference(make_checkpoint, arch)
    ref_tokens = []
    for step in generate_step(mx.array(PROMPT), reference, max_tokens=64):
        ref_tokens.append(int(step[0]))
    assert len(ref_tokens) == 64
    assert "".join(pieces) == tokenizer.decode(ref_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_native_bf16_logits_stay_close_to_float32(model_store, created_model, arch):
    native = load_model(model_store, created_model(arch), "native")
    assert native.compute == "native"
    assert native.model.model.embed_tokens.weight.dtype == mx.bfloat16
    full = load_model(model_store, created_model(arch), "float32")
    tokens = mx.array([PROMPT])
    assert _cosine_min(native.model(tokens), full.model(tokens)) >= 0.999


@pytest.mark.parametrize("quant,threshold", [("int8", 0.99), ("mxfp8", 0.99), ("int4", 0.95),
                                             ("nvfp4", 0.95), ("mxfp4", 0.95)])
@pytest.mark.parametrize("compute", ["native", "float32"])
def test_quantized_logits_close_to_unquantized(model_store, created_model, quant, threshold,
                                               compute):
    reference = load_model(model_store, created_model("llama"), "float32")
    loaded = load_model(model_store, created_model("llama", quant), compute)
    tokens = mx.array([PROMPT])
    if compute == "native":  # really running quantized kernels, not expanded weights
        assert type(loaded.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
        assert loaded.weights_bytes < reference.weights_bytes / 2
    assert _cosine_min(loaded.model(tokens), reference.model(tokens)) >= threshold


def test_qwen3_int4_native_uses_tied_head_and_promoted_types(model_store, created_model):
    loaded = load_model(model_store, created_model("qwen3", "int4"), "native")
    assert "lm_head" not in loaded.model
    attn = loaded.model.layers[0].self_attn
    assert (attn.q_proj.bits, attn.k_proj.bits) == (4, 8)  # create promotes k/v to 8-bit
    reference = load_model(model_store, created_model("qwen3"), "float32")
    tokens = mx.array([PROMPT])
    assert _cosine_min(loaded.model(tokens), reference.model(tokens)) >= 0.95


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"type": "linear", "factor": 2.0},
    None,
])
def test_rope_matches_mlx_lm(scaling):
    x = mx.random.normal((1, 4, 9, 64), key=mx.random.key(1))
    ours = RoPE(64, 500000.0, scaling)(x, offset=5)
    theirs = initialize_rope(64, 500000.0, False, scaling, 131072)(x, offset=5)
    assert mx.abs(ours - theirs).max().item() <= 1e-5
