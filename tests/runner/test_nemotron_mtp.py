"""Nemotron-H's MTP head as the model's inline draft: the head against its equations (numpy,
from the checkpoint's own tensors), create keeping `mtp.*` at source precision, recurrent
layers taking back a verify pass, greedy speculation equal to plain decode with acceptances and
rejections both, the runner's HTTP path reporting draft counts, and the VL model with an image.
(bench/mtp_parity_mlx_vlm.py compares the head with mlx-vlm 0.7.10's NemotronHMTPDraftModel.)"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import serve_app
from nemotron_fixture import write_nemotron_checkpoint
from nemotron_vl_fixture import write_nemotron_vl_checkpoint

from registry.names import Name
from registry.safetensors_header import read_header
from registry.store import Store
from runner.generate import Done, Generator
from runner.kv_cache import RecurrentCache
from runner.load import load_model
from runner.media.assemble import assemble, bind, key_images
from runner.media.prompt import MARKER, ImageSlots
from runner.mtp_draft import MTPDrafter, feed
from runner.nn.ssm import Mamba2Mixer
from runner.quant import parse_quant_type
from runner.sample import Options
from runner.server import build_app
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create
from workflows.create.errors import CreateError

PROMPT = [random.Random(3).randrange(5, 2048) for _ in range(40)]
ECHO = {"mtp": "echo", "tie_word_embeddings": True, "embed_scale": 4.0}  # repeats, partly


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, make_checkpoint):
    tokenizer = Path(make_checkpoint("llama"))
    root = tmp_path_factory.mktemp("nemotron-mtp")
    return {"random": write_nemotron_checkpoint(root / "random", tokenizer, mtp="random"),
            "echo": write_nemotron_checkpoint(root / "echo", tokenizer, **ECHO)}


@pytest.fixture(scope="module")
def store(tmp_path_factory, checkpoints) -> Store:
    store = Store(tmp_path_factory.mktemp("nemotron-mtp-store"))
    for name, path, quant in (("t/mtp", checkpoints["random"], None),
                              ("t/mtp-int4", checkpoints["random"], "int4"),
                              ("t/echo", checkpoints["echo"], None)):
        options = CreateOptions(quantize=parse_quant_type(quant) if quant else None)
        create(Name.parse(name), path, options, store, lambda event: None, threading.Event())
    return store


def _load(store: Store, name: str):
    loaded = load_model(store, name, "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: let num_predict decide the length
    return loaded, tokenizer


def _generate(loaded, tokenizer, options, drafting=True, prompt=PROMPT, **kwargs):
    generator = Generator(loaded.model, tokenizer, loaded.context_length, **kwargs)
    generator.drafting = generator.drafting and drafting
    items = list(generator.generate(prompt, options))
    done = items.pop()
    assert isinstance(done, Done)
    return generator, done


# ---- the head against its equations ----

def _bf16_file(path: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


def _rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _reference_head(t: dict[str, np.ndarray], config: dict, embedded: np.ndarray,
                    hidden: np.ndarray) -> np.ndarray:
    """The head over a sequence (causal), from the equations in _nemotron_h_mtp's docstring."""
    p = "mtp.layers."
    h = np.concatenate([_rms(embedded, t[p + "0.enorm.weight"]),
                        _rms(hidden, t[p + "0.hnorm.weight"])], -1) @ t[p + "0.eh_proj.weight"].T
    heads, kv, dim = (config["num_attention_heads"], config["num_key_value_heads"],
                      config["head_dim"])
    length = h.shape[0]
    # layer 0: attention, no positional encoding, causal
    x = _rms(h, t[p + "0.norm.weight"])
    q = (x @ t[p + "0.mixer.q_proj.weight"].T).reshape(length, heads, dim)
    k = (x @ t[p + "0.mixer.k_proj.weight"].T).reshape(length, kv, dim)
    v = (x @ t[p + "0.mixer.v_proj.weight"].T).reshape(length, kv, dim)
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", weights, v).reshape(length, -1)
    h = h + out @ t[p + "0.mixer.o_proj.weight"].T
    # layer 1: mixture of experts
    x = _rms(h, t[p + "1.norm.weight"])
    m = p + "1.mixer."
    scores = 1 / (1 + np.exp(-(x @ t[m + "gate.weight"].T)))
    biased = scores + t[m + "gate.e_score_correction_bias"]
    groups, keep, top = config["n_group"], config["topk_group"], config["num_experts_per_tok"]
    y = np.zeros_like(h)
    for row in range(length):
        by_group = biased[row].reshape(groups, -1)
        best = np.sort(by_group, -1)[:, -2:].sum(-1)
        allowed = np.zeros_like(by_group)
        allowed[np.argsort(-best)[:keep]] = 1
        masked = np.where(allowed.reshape(-1) > 0, biased[row], 0.0)
        chosen = np.argsort(-masked)[:top]
        gates = scores[row, chosen] / scores[row, chosen].sum() * config["routed_scaling_factor"]
        for e, g in zip(chosen, gates, strict=True):
            up = t[f"{m}experts.{e}.up_proj.weight"]
            down = t[f"{m}experts.{e}.down_proj.weight"]
            y[row] += g * (np.maximum(x[row] @ up.T, 0) ** 2 @ down.T)
    shared = np.maximum(x @ t[m + "shared_experts.up_proj.weight"].T, 0) ** 2
    h = h + y + shared @ t[m + "shared_experts.down_proj.weight"].T
    return _rms(h, t[p + "1.final_layernorm.weight"])


def test_the_head_follows_its_equations_in_one_call_and_step_by_step(store, checkpoints):
    loaded, _ = _load(store, "t/mtp")
    head = loaded.model.draft_head()
    assert head is not None
    config = json.loads((checkpoints["random"] / "config.json").read_text())
    tensors = {k: v.astype(np.float64) for k, v in
               _bf16_file(checkpoints["random"] / "model.safetensors").items()}
    tokens = PROMPT[1:13]
    hidden = np.random.default_rng(1).standard_normal((12, config["hidden_size"]))
    expected = _reference_head(tensors, config, tensors["backbone.embeddings.weight"][tokens],
                               hidden)
    whole = feed(loaded.model, head, tokens, mx.array(hidden, mx.float32)[None],
                 head.make_cache())[0]
    caches = head.make_cache()
    steps = [feed(loaded.model, head, tokens[:5], mx.array(hidden[:5], mx.float32)[None],
                  caches)[0]]
    steps += [feed(loaded.model, head, [tokens[i]], mx.array(hidden[i:i + 1], mx.float32)[None],
                   caches)[0] for i in range(5, 12)]
    for ours in (whole, mx.concatenate(steps)):
        assert np.abs(np.array(ours) - expected).max() < 1e-4
    # the draft logits: the target's own lm_head over the head's output
    logits = np.array(loaded.model._logits(whole))
    assert np.abs(logits - expected @ tensors["lm_head.weight"].T).max() < 1e-4


# ---- loading and create ----

def test_create_keeps_the_head_at_source_precision_and_loads_it(store):
    manifest = store.get_model(Name.parse("t/mtp-int4")).manifest()
    heads = [layer for layer in manifest.layers if (layer.name or "").startswith("mtp.")]
    assert heads and any(layer.name.endswith("experts.up_proj.weight") for layer in heads)
    for layer in heads:
        header = read_header(store.blob_path(layer.digest))
        assert all(info["dtype"] == "BF16" for name, info in header.items()
                   if name != "__metadata__"), layer.name
    loaded, tokenizer = _load(store, "t/mtp-int4")
    assert loaded.model.draft_head() is not None
    assert Generator(loaded.model, tokenizer, loaded.context_length).drafting


def test_a_config_declaring_a_head_without_its_tensors_loads_without_a_draft(
        tmp_path, make_checkpoint):
    path = write_nemotron_checkpoint(tmp_path / "c", Path(make_checkpoint("llama")),
                                     mtp="random")
    weights = {k: v for k, v in _bf16_file(path / "model.safetensors").items()
               if not k.startswith("mtp.")}
    from nemotron_fixture import write_safetensors_bf16
    write_safetensors_bf16(path / "model.safetensors", weights)
    store = Store(tmp_path / "s")
    create(Name.parse("t/no-head"), path, CreateOptions(), store, lambda event: None,
           threading.Event())
    loaded, tokenizer = _load(store, "t/no-head")
    assert loaded.model.draft_head() is None
    assert not Generator(loaded.model, tokenizer, loaded.context_length).drafting


@pytest.mark.parametrize("damage", ["reshaped", "missing"])
def test_create_refuses_a_head_in_the_wrong_shape_or_in_part(tmp_path, make_checkpoint, damage):
    path = write_nemotron_checkpoint(tmp_path / "c", Path(make_checkpoint("llama")),
                                     mtp="random")
    weights = _bf16_file(path / "model.safetensors")
    victim = "mtp.layers.0.eh_proj.weight"
    if damage == "missing":
        del weights[victim]
    else:
        weights[victim] = weights[victim][:, :-1]
    from nemotron_fixture import write_safetensors_bf16
    write_safetensors_bf16(path / "model.safetensors", weights)
    store = Store(tmp_path / "s")
    with pytest.raises(CreateError, match=victim.replace(".", r"\.")) as refused:
        create(Name.parse("t/bad-head"), path, CreateOptions(), store, lambda event: None,
               threading.Event())
    assert ("missing" if damage == "missing" else "implies") in str(refused.value)
    assert not store.list_models()


# ---- taking back a verify pass in a recurrent layer ----

def test_a_recurrent_layer_rewinds_within_a_verify_pass_to_what_plain_steps_give():
    mx.random.seed(0)
    mixer = Mamba2Mixer(32, 4, 8, 2, 8, 4, 1e-5, (0.0, float("inf")))
    mixer.update({"A_log": mx.random.uniform(0, 2, (4,)),
                  "dt_bias": mx.random.uniform(-3, -1, (4,)),
                  "conv1d": {"weight": 0.3 * mx.random.normal((64, 4, 1))}})
    x = mx.random.normal((1, 9, 32))
    plain = RecurrentCache()
    mixer(x[:, :4], plain)
    for t in range(4, 6):
        mixer(x[:, t:t + 1], plain)
    verified = RecurrentCache()
    mixer(x[:, :4], verified)
    verified.keep_steps = True
    mixer(x[:, 4:9], verified)  # a verify pass over five positions
    verified.keep_steps = False
    verified.rewind(6)  # two kept
    assert verified.offset == plain.offset == 6
    for ours, theirs in ((verified.conv, plain.conv), (verified.ssm, plain.ssm)):
        assert mx.abs(ours - theirs).max().item() < 1e-5
    with pytest.raises(ValueError):
        verified.rewind(3)  # before the recorded pass


# ---- speculation ----

def test_greedy_with_the_head_equals_plain_decode_with_acceptances_and_rejections(store):
    loaded, tokenizer = _load(store, "t/echo")
    options = Options(temperature=0, num_predict=90)
    plain, plain_done = _generate(loaded, tokenizer, options, drafting=False)
    spec, done = _generate(loaded, tokenizer, options)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 90
    assert plain_done.draft is None and done.draft is not None
    assert 0 < done.draft.accepted < done.draft.proposed  # both kept and rejected proposals
    # a random head is almost never right: parked, and still the target's output
    loaded, tokenizer = _load(store, "t/mtp")
    plain, _ = _generate(loaded, tokenizer, options, drafting=False)
    spec, done = _generate(loaded, tokenizer, options)
    assert spec.tokens == plain.tokens
    assert done.draft is not None and done.draft.accepted < done.draft.proposed < 90


def test_sampling_with_the_head_is_seeded(store):
    loaded, tokenizer = _load(store, "t/echo")
    options = Options(temperature=0.8, seed=11, num_predict=40)
    first, done = _generate(loaded, tokenizer, options)
    second, _ = _generate(loaded, tokenizer, options)
    assert first.tokens == second.tokens and len(first.tokens) == 40
    assert done.draft is not None and done.draft.proposed > 0


def test_a_second_turn_resumes_target_and_head_caches_from_the_trie(store):
    loaded, tokenizer = _load(store, "t/echo")
    options = Options(temperature=0, num_predict=24)
    warm = Generator(loaded.model, tokenizer, loaded.context_length)
    list(warm.generate(PROMPT, options))
    second = PROMPT + warm.tokens + [5, 77, 901]
    *_, done = warm.generate(second, options)
    cold = Generator(loaded.model, tokenizer, loaded.context_length)
    cold.drafting = False
    list(cold.generate(second, options))
    assert done.prompt_cached == len(PROMPT) + 23  # the head level with the target
    assert warm.tokens == cold.tokens
    assert done.draft is not None and done.draft.accepted > 0


def test_the_runner_reports_the_heads_proposals(store):
    app = build_app(store, "t/echo", "float32")
    with serve_app(app) as url:
        deadline = time.monotonic() + 60
        while (status := httpx.get(f"{url}/v1/status").json())["status"] != "ready":
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["draft"] is True
        body = {"prompt": "hello there, how are you", "options": {"temperature": 0,
                                                                "num_predict": 40}}
        lines = httpx.post(f"{url}/v1/completions", json=body, timeout=120).text.splitlines()
    final = json.loads(lines[-1])
    assert final["done"] is True
    assert 0 < final["draft_accepted"] <= final["draft_proposed"]


# ---- the VL model: an image in the prompt ----

def test_vl_with_an_image_and_the_head_equals_plain_decode(tmp_path, make_checkpoint):
    """Created (the head under `language_model.mtp.`, its experts stacked), loaded as the
    runner loads it; a prompt with an image decodes as plain decode does."""
    import io

    from nemotron_vl_fixture import VL_CONFIG
    from PIL import Image

    from registry.manifests import ModelConfig

    llm = {**VL_CONFIG["llm_config"], "tie_word_embeddings": True}
    path = write_nemotron_vl_checkpoint(tmp_path / "vl", Path(make_checkpoint("llama")),
                                        mtp="echo", embed_scale=4.0, llm_config=llm)
    store = Store(tmp_path / "store")
    create(Name.parse("t/vl-mtp"), path, CreateOptions(), store, lambda event: None,
           threading.Event())
    manifest = store.get_model(Name.parse("t/vl-mtp")).manifest()
    assert manifest.config is not None
    config = ModelConfig.from_json(store.read_blob(manifest.config.digest))
    assert "vision" in (config.capabilities or []) and config.draft is None
    loaded = load_model(store, "t/vl-mtp", "float32")
    model = loaded.model
    assert model.draft_head() is not None
    pixels = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    request = assemble(model, loaded.files.files, [0, 7, MARKER, *PROMPT[:20]],
                       [png.getvalue()])
    key_images(request, request.tokens, ImageSlots(), lambda: None)
    bind(model, request)
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()
    options = Options(temperature=0, num_predict=60)
    runs = []
    for drafting in (False, True):
        generator = Generator(model, tokenizer, 2048, prefill_chunk=16)
        generator.drafting = generator.drafting and drafting
        *_, done = generator.generate(request.tokens, options, spans=request.spans)
        runs.append((generator.tokens, done))
    (plain, _), (spec, done) = runs
    assert spec == plain and len(plain) == 60
    assert done.draft is not None and 0 < done.draft.accepted < done.draft.proposed


def test_drafter_offsets_pair_hidden_t_with_token_t_plus_1(store):
    """After prefill the head's cache ends where the target's does; a verify pass that keeps
    `a` proposals leaves `a + 1` target positions pending."""
    loaded, tokenizer = _load(store, "t/echo")
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    match = generator.prefix_cache.begin(PROMPT, generator.make_caches)
    generator.prefill(match)
    target, head = (match.caches[:generator.target_layers],
                    match.caches[generator.target_layers:])
    assert head[0].offset == target[0].offset == len(PROMPT) - 1
    drafter = MTPDrafter(loaded.model, generator.head, head)
    hidden = mx.zeros((1, 4, loaded.model.args.hidden_size))
    drafter.commit(len(PROMPT) - 1, 3, 2, hidden)
    assert head[0].offset == len(PROMPT) - 1 and drafter.pending[0].shape[1] == 3


def test_a_hybrid_target_with_a_separate_draft_model_decodes_as_plain(tmp_path, checkpoints,
                                                                     make_checkpoint):
    """A (llama) draft model beside a Nemotron-H target, whose Mamba layers take back each
    verify pass: the target's greedy output, and the trie keeps the turn (the draft catches up
    at the end). A hybrid draft (its own recurrent layers cannot rewind) is not used."""
    store = Store(tmp_path / "store")
    for name, draft in (("t/llama-draft", Path(make_checkpoint("llama"))),
                        ("t/hybrid-draft", checkpoints["random"])):
        create(Name.parse(name), checkpoints["echo"], CreateOptions(draft_dir=draft), store,
               lambda event: None, threading.Event())
    loaded, tokenizer = _load(store, "t/llama-draft")
    assert loaded.draft is not None and loaded.model.draft_head() is not None
    options = Options(temperature=0, num_predict=40)
    plain, _ = _generate(loaded, tokenizer, options, drafting=False)
    spec, done = _generate(loaded, tokenizer, options, draft=loaded.draft)
    assert spec.tokens == plain.tokens
    assert done.draft is not None and done.draft.accepted < done.draft.proposed
    *_, again = spec.generate(PROMPT + spec.tokens + [5, 6], options)
    assert again.prompt_cached == len(PROMPT) + 39
    loaded, tokenizer = _load(store, "t/hybrid-draft")
    assert not Generator(loaded.model, tokenizer, loaded.context_length,
                         draft=loaded.draft).drafting


@pytest.mark.parametrize("ask", ["logprobs", "repeat_penalty"])
def test_a_request_that_does_not_speculate_keeps_the_head_level_for_the_trie(store, ask):
    """Logprobs or a repeat penalty turn drafting off for the request; the head's cache still
    ends where the target's does, so the next turn resumes from the trie."""
    loaded, tokenizer = _load(store, "t/echo")
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    options = Options(temperature=0, num_predict=16,
                      repeat_penalty=1.3 if ask == "repeat_penalty" else 1.0)
    kwargs: dict = {"logprobs": 1} if ask == "logprobs" else {}
    *_, done = generator.generate(PROMPT, options, **kwargs)
    assert done.draft is None
    answer = generator.tokens
    *_, again = generator.generate(PROMPT + answer + [5, 6], Options(temperature=0,
                                                                     num_predict=8))
    assert again.prompt_cached == len(PROMPT) + len(answer) - 1
