"""Gemma 3 soft-capping (`attn_logit_softcapping`, `final_logit_softcapping`) against mlx-lm.

mlx-lm's gemma3_text ignores both keys, so the reference is mlx-lm's gemma3_text with its
attention replaced by the equations of mlx-lm's gemma2.py (scale, scores, tanh cap, mask, precise
softmax) and its logits capped as gemma2's Model does, written out here independently of ferry's
`attend`. The caps are small enough to bend this random-weight model's scores and logits, so a
runner that ignored either would fail (checked too)."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm
import mlx_lm.models.gemma3_text as mlx_gemma3_text
import mlx_models
import pytest
from arch_checkpoints import write_checkpoint
from mlx_lm.generate import generate_step

from registry.names import Name
from runner.generate import Generator
from runner.kernels import qmatvec
from runner.load import load_model
from runner.nn.attention import attend
from runner.quant import parse_quant_type
from runner.sample import Options
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture
PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]
CAPS = {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 0.2}


def gemma2_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                     mask: mx.array | str | None, cap: float) -> mx.array:
    """mlx-lm gemma2.py's Attention.__call__ after RoPE and the cache (GQA by expand_dims)."""
    b, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    repeats = heads // kv_heads
    q = (q * scale).reshape(b, kv_heads, repeats, length, dim)
    k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    scores = mx.tanh(scores / cap)
    scores *= cap
    if isinstance(mask, str):
        total = k.shape[-2]
        mask = mx.arange(total)[None] <= (mx.arange(length) + total - length)[:, None]
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    scores = mx.softmax(scores, precise=True, axis=-1)
    return (scores @ v).reshape(b, heads, length, dim)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, make_checkpoint) -> dict[str, Path]:
    tokenizer = Path(make_checkpoint("llama"))
    return {
        "capped": write_checkpoint(tmp_path_factory.mktemp("gemma3-capped"), "gemma3",
                                   tokenizer, **CAPS),
        "capped_mm": write_checkpoint(tmp_path_factory.mktemp("gemma3mm-capped"), "gemma3_mm",
                                      tokenizer, text_config=_mm_text_config()),
    }


def _mm_text_config() -> dict:
    from arch_checkpoints import CONFIGS
    return {**CONFIGS["gemma3_mm"]["text_config"], **CAPS}


@pytest.fixture(scope="module")
def capped(model_store, checkpoints) -> str:
    name = "test/gemma3-softcap"
    create(Name.parse(name), checkpoints["capped"], CreateOptions(), model_store,
           lambda event: None, threading.Event())
    return name


@pytest.fixture
def reference(checkpoints, monkeypatch):
    """mlx-lm's gemma3_text on the capped checkpoint, capped as gemma2 caps."""
    cap = CAPS["attn_logit_softcapping"]

    def capped_sdpa(q, k, v, cache, scale, mask, sinks=None):
        return gemma2_attention(q, k, v, scale, mask, cap)

    monkeypatch.setattr(mlx_gemma3_text, "scaled_dot_product_attention", capped_sdpa)
    model, _ = mlx_lm.load(str(checkpoints["capped"]))
    model.set_dtype(mx.float32)
    return _CappedModel(model, CAPS["final_logit_softcapping"])


@pytest.mark.parametrize("length,keys,mask", [
    (7, 7, "causal"), (3, 10, "causal"), (1, 9, None), (5, 12, "window"),
])
def test_attend_matches_gemma2_equations(length, keys, mask):
    rng = mx.random.key(3)
    q, k, v = (mx.random.normal(shape, key=mx.random.split(rng, 3)[i])
               for i, shape in enumerate([(1, 4, length, 16), (1, 2, keys, 16),
                                          (1, 2, keys, 16)]))
    q = q * 4  # scores of a few units, where a cap of 1.5 bends them
    if mask == "window":
        queries = mx.arange(keys - length, keys)[:, None]
        positions = mx.arange(keys)[None]
        mask = (positions <= queries) & (positions > queries - 4)
    ours = attend(q, k, v, 0.25, mask, 1.5)
    theirs = gemma2_attention(q, k, v, 0.25, mask, 1.5)
    assert mx.abs(ours - theirs).max().item() <= 1e-5
    uncapped = attend(q, k, v, 0.25, mask, None)
    assert mx.abs(ours - uncapped).max().item() > 1e-2  # the cap changes the result


@pytest.mark.parametrize("compute", ["float32", "native"])
def test_capped_logits_match_the_reference(model_store, capped, reference, compute):
    loaded = load_model(model_store, capped, compute)
    tokens = mx.array([PROMPT])
    ours = loaded.model(tokens).astype(mx.float32)
    assert mx.abs(ours - reference(tokens)).max().item() <= 1e-4
    assert mx.abs(ours).max().item() < CAPS["final_logit_softcapping"]
    for layer in loaded.model.layers:  # the attention cap matters here, not only the final one
        layer.self_attn.softcap = None
    assert mx.abs(loaded.model(tokens) - ours).max().item() > 1e-3


def test_capped_greedy_tokens_match_the_reference(model_store, capped, reference):
    loaded = load_model(model_store, capped, "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: compare all 24, never stop early
    pieces = list(Generator(loaded.model, tokenizer, loaded.context_length).generate(
        PROMPT, Options(temperature=0, num_predict=24)))
    assert pieces.pop().eval_count == 24
    # generate_step decodes through mlx-lm's caches (rotating for the window-8 local layers)
    ref_tokens = [int(step[0]) for step in generate_step(mx.array(PROMPT), reference,
                                                         max_tokens=24)]
    assert "".join(pieces) == tokenizer.decode(ref_tokens)


class _CappedModel:
    """mlx-lm's model with gemma2's final logit cap, as generate_step calls a model."""

    def __init__(self, model, cap: float) -> None:
        self.model, self.cap = model, cap
        self.layers = model.layers

    def __call__(self, tokens, cache=None, **kwargs):
        return mx.tanh(self.model(tokens, cache=cache, **kwargs) / self.cap) * self.cap

    def make_cache(self):
        return self.model.make_cache()


def test_multimodal_span_path_is_capped_too(model_store, checkpoints):
    """A one-token image span masks exactly as causal attention does: gemma3.py's span path
    must give the plain path's logits, soft-capped the same way."""
    name = "test/gemma3mm-softcap"
    create(Name.parse(name), checkpoints["capped_mm"], CreateOptions(), model_store,
           lambda event: None, threading.Event())
    loaded = load_model(model_store, name, "float32")
    tokens = mx.array([PROMPT])
    plain = loaded.model(tokens)
    spanned = loaded.model(tokens, spans=[(4, 5)])
    assert mx.abs(plain - spanned).max().item() <= 1e-5
    loaded.model.layers[0].self_attn.softcap = None
    assert mx.abs(loaded.model(tokens, spans=[(4, 5)]) - plain).max().item() > 1e-3


def test_fused_path_caps_as_the_float32_path_does(model_store, checkpoints):
    """int8 on the fused kernel's path: the same greedy tokens as int8 dequantized to float32
    (only the linear layers differ between the two; attention and its cap are shared)."""
    assert qmatvec.available(), "the fused kernel needs a C compiler"
    name = "test/gemma3-softcap-int8"
    create(Name.parse(name), checkpoints["capped"],
           CreateOptions(quantize=parse_quant_type("int8")), model_store, lambda event: None,
           threading.Event())
    texts = []
    for compute in ("fused", "float32"):
        loaded = load_model(model_store, name, compute)
        assert loaded.model.layers[0].self_attn.softcap == CAPS["attn_logit_softcapping"]
        tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
        tokenizer.eos_ids.clear()
        texts.append("".join(str(p) for p in Generator(
            loaded.model, tokenizer, loaded.context_length).generate(
                PROMPT, Options(temperature=0, num_predict=16)) if isinstance(p, str)))
    assert texts[0] == texts[1]
