"""The architectures beyond llama/qwen3 against mlx-lm on the same random-weight checkpoints:
float32 logits within 1e-3 and 32 greedy tokens identical; created through the real create
pipeline (which validates each against its architecture file's shapes)."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_models
import pytest
from arch_checkpoints import write_checkpoint
from mlx_lm.generate import generate_step

from registry.names import Name
from runner.generate import Generator
from runner.kv_cache import KVCache
from runner.load import load_model
from runner.nn.switch_linear import QuantizedSwitchLinear
from runner.quant import parse_quant_type
from runner.sample import Options
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture
PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]
ARCHS = ["qwen2", "mistral", "gemma3", "gemma3_mm", "qwen3_moe"]
_dirs: dict[str, Path] = {}


@pytest.fixture(scope="module")
def arch_checkpoint(tmp_path_factory, make_checkpoint):
    def build(arch: str) -> Path:
        if arch not in _dirs:
            out = tmp_path_factory.mktemp(f"arch-{arch}")
            _dirs[arch] = write_checkpoint(out, arch, Path(make_checkpoint("llama")))
        return _dirs[arch]
    return build


@pytest.fixture(scope="module")
def arch_model(model_store, arch_checkpoint):
    made: dict[str, str] = {}

    def build(arch: str) -> str:
        if arch not in made:
            made[arch] = f"test/arch-{arch}"
            create(Name.parse(made[arch]), arch_checkpoint(arch), CreateOptions(), model_store,
                   lambda event: None, threading.Event())
        return made[arch]
    return build


def _reference(path: Path):
    model, _ = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_logits_match_mlx_lm(model_store, arch_model, arch_checkpoint, arch):
    loaded = load_model(model_store, arch_model(arch), "float32")
    tokens = mx.array([PROMPT])
    reference = _reference(arch_checkpoint(arch))(tokens)
    assert mx.abs(loaded.model(tokens) - reference).max().item() <= 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_identical_to_mlx_lm(model_store, arch_model, arch_checkpoint, arch):
    loaded = load_model(model_store, arch_model(arch), "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: compare all 32, never stop early
    pieces = list(Generator(loaded.model, tokenizer, loaded.context_length).generate(
        PROMPT, Options(temperature=0, num_predict=32)))
    assert pieces.pop().eval_count == 32
    reference = _reference(arch_checkpoint(arch))
    ref_tokens = [int(step[0]) for step in generate_step(mx.array(PROMPT), reference,
                                                         max_tokens=32)]
    assert "".join(pieces) == tokenizer.decode(ref_tokens)


def test_mistral_sliding_window_hides_what_lies_beyond_it(model_store, arch_model):
    loaded = load_model(model_store, arch_model("mistral"), "float32")
    for layer in loaded.model.layers:
        layer.self_attn.window = 4  # 4 layers x 3 positions back: token 0 reaches position 12
    prompt = [17 + i for i in range(20)]
    changed = [900, *prompt[1:]]
    ours, theirs = loaded.model(mx.array([prompt])), loaded.model(mx.array([changed]))
    assert mx.abs(ours[0, 13:] - theirs[0, 13:]).max().item() == 0
    assert mx.abs(ours[0, 12] - theirs[0, 12]).max().item() > 0
    cache = [KVCache() for _ in loaded.model.layers]  # decoding past the window, one at a time
    steps = [loaded.model(mx.array([prompt[:6]]), cache)[0, -1]]
    steps += [loaded.model(mx.array([[t]]), cache)[0, -1] for t in prompt[6:]]
    assert mx.abs(mx.stack(steps) - ours[0, 5:]).max().item() <= 1e-4


def test_qwen3_moe_long_prompt_sorted_by_expert_matches_mlx_lm(model_store, arch_model,
                                                               arch_checkpoint):
    loaded = load_model(model_store, arch_model("qwen3_moe"), "float32")
    tokens = mx.array([[(7 * i + 3) % 2000 for i in range(48)]])  # 96 routed pairs: sorted
    reference = _reference(arch_checkpoint("qwen3_moe"))(tokens)
    assert mx.abs(loaded.model(tokens) - reference).max().item() <= 1e-3


def test_qwen3_moe_int4_create_keeps_experts_quantized(model_store, arch_checkpoint):
    name = "test/arch-qwen3_moe-int4"
    create(Name.parse(name), arch_checkpoint("qwen3_moe"),
           CreateOptions(quantize=parse_quant_type("int4")), model_store, lambda event: None,
           threading.Event())
    loaded = load_model(model_store, name, "native")
    experts = loaded.model.layers[0].mlp.experts
    assert isinstance(experts.gate_proj, QuantizedSwitchLinear) and experts.gate_proj.bits == 4
    assert experts.down_proj.bits == 8  # int4 promotes down_proj (reference 2.2)
    assert loaded.model.layers[0].mlp.gate.weight.dtype == mx.float32  # the router is kept
    full = load_model(model_store, name, "float32")
    reference = _reference(arch_checkpoint("qwen3_moe"))(mx.array([PROMPT]))
    assert _cosine_min(loaded.model(mx.array([PROMPT])), reference) >= 0.95
    assert _cosine_min(full.model(mx.array([PROMPT])), reference) >= 0.95


def _cosine_min(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    cos = mx.sum(a * b, -1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
    return cos.min().item()


def test_gemma3_multimodal_int8_create_runs_its_text_half_quantized(model_store,
                                                                    arch_checkpoint):
    name = "test/arch-gemma3_mm-int8"
    create(Name.parse(name), arch_checkpoint("gemma3_mm"),
           CreateOptions(quantize=parse_quant_type("int8")), model_store, lambda event: None,
           threading.Event())
    loaded = load_model(model_store, name, "native")
    assert loaded.model.layers[0].self_attn.q_proj.bits == 8  # language_model.* names matched
    reference = _reference(arch_checkpoint("gemma3_mm"))(mx.array([PROMPT]))
    assert _cosine_min(loaded.model(mx.array([PROMPT])), reference) >= 0.99


def test_qwen3_moe_bf16_on_the_native_path_runs_on_a_cpu(model_store, arch_model):
    """MLX's CPU gather_mm takes float32 only: a half-precision model that `auto` leaves native
    (too big for float32) still routes its tokens, decode- and prefill-sized alike."""
    native = load_model(model_store, arch_model("qwen3_moe"), "native")
    native.model.set_dtype(mx.bfloat16)  # as a bf16 checkpoint loads (the fixture is float32)
    full = load_model(model_store, arch_model("qwen3_moe"), "float32")
    for tokens in (mx.array([PROMPT[:1]]), mx.array([PROMPT]),
                   mx.array([[(7 * i + 3) % 2000 for i in range(48)]])):  # the sorted path
        assert _cosine_min(native.model(tokens), full.model(tokens)) >= 0.99
