"""Speculative decoding: a draft loaded from the model's `draft.` layers, greedy output equal to
plain decoding token for token, full acceptance when the draft is the target itself, seeded
sampling, and the release rule across rounds that emit several tokens."""

from __future__ import annotations

import json
import threading
import time

import httpx
import mlx_models
import pytest
from conftest import serve_app

from registry.names import Name
from runner.generate import Done, Generator
from runner.load import load_model
from runner.sample import Options
from runner.server import build_app
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture

PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2]


@pytest.fixture(scope="module")
def drafted(model_store, make_checkpoint):
    """`drafted(seed)`: the tiny llama with the draft checkpoint of `seed` (0: itself)."""
    made: dict[int, str] = {}

    def build(seed: int) -> str:
        if seed not in made:
            name = f"test/drafted-{seed}"
            options = CreateOptions(draft_dir=make_checkpoint("llama", seed=seed))
            create(Name.parse(name), make_checkpoint("llama"), options, model_store,
                   lambda event: None, threading.Event())
            made[seed] = name
        return made[seed]

    return build


@pytest.fixture(scope="module")
def loaded_self(model_store, drafted):
    return _load(model_store, drafted(0))


def _load(store, name):
    loaded = load_model(store, name, "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: let num_predict decide the length
    return loaded, tokenizer


def _generate(loaded, tokenizer, options, draft=True, **kwargs):
    generator = Generator(loaded.model, tokenizer, loaded.context_length,
                          draft=loaded.draft if draft else None, **kwargs)
    pieces = list(generator.generate(PROMPT, options))
    done = pieces.pop()
    assert isinstance(done, Done)
    return generator, "".join(pieces), done


def test_draft_is_loaded_from_the_draft_layers(loaded_self):
    loaded, _ = loaded_self
    assert loaded.draft is not None and loaded.files.draft_config is not None
    assert len(loaded.draft.layers) == loaded.files.draft_config["num_hidden_layers"]
    assert all(not name.startswith("draft.") for name, _ in loaded.files.tensor_blobs)


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_output_with_a_draft_equals_plain_greedy_token_for_token(model_store, drafted,
                                                                        seed):
    loaded, tokenizer = _load(model_store, drafted(seed))
    options = Options(temperature=0, num_predict=80)
    plain, plain_text, plain_done = _generate(loaded, tokenizer, options, draft=False)
    spec, spec_text, spec_done = _generate(loaded, tokenizer, options)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 80
    assert spec_text == plain_text
    assert plain_done.draft is None and spec_done.draft is not None
    assert spec_done.draft.proposed > 0


def test_the_target_as_its_own_draft_accepts_every_proposal(loaded_self):
    _, _, done = _generate(*loaded_self, Options(temperature=0, num_predict=70))
    assert done.draft is not None and done.eval_count == 70
    assert done.draft.proposed >= 50
    assert done.draft.accepted == done.draft.proposed


def test_a_different_draft_is_rejected_sometimes_and_output_is_unchanged(model_store, drafted):
    loaded, tokenizer = _load(model_store, drafted(1))
    _, _, done = _generate(loaded, tokenizer, Options(temperature=0, num_predict=64))
    assert done.draft is not None and done.draft.accepted < done.draft.proposed


def test_sampling_with_a_draft_is_seeded_and_accepts_its_own_proposals(loaded_self):
    options = Options(temperature=0.9, seed=11, num_predict=60)
    _, text, done = _generate(*loaded_self, options)
    _, again, _ = _generate(*loaded_self, options)
    _, other, _ = _generate(*loaded_self, Options(temperature=0.9, seed=12, num_predict=60))
    assert text == again and text != other
    assert done.draft is not None and done.draft.accepted >= 0.9 * done.draft.proposed


def test_release_rule_holds_when_rounds_step_over_256(loaded_self):
    loaded, tokenizer = loaded_self
    calls: list[int] = []
    generator = Generator(loaded.model, tokenizer, loaded.context_length, draft=loaded.draft,
                          release=lambda: calls.append(generator.generated), prefill_chunk=64)
    prompt = (PROMPT * 20)[:200]  # 199 prefilled tokens: 4 chunks each, target and draft
    pieces = list(generator.generate(prompt, Options(temperature=0, num_predict=600)))
    assert pieces[-1].eval_count == 600
    assert calls[:8] == [0] * 8
    crossings = calls[8:-1]
    assert len(crossings) == 2 and calls[-1] == 600
    assert 256 < crossings[0] <= 260 and 512 < crossings[1] <= 516  # 5-token rounds


def test_runner_reports_the_draft_and_its_acceptance(model_store, drafted):
    app = build_app(model_store, drafted(0), "float32")
    with serve_app(app) as url:
        status = _wait_ready(url)
        assert status["draft"] is True
        body = {"prompt": "hello", "options": {"temperature": 0, "num_predict": 12}}
        lines = httpx.post(f"{url}/v1/completions", json=body, timeout=60).text.splitlines()
    final = json.loads(lines[-1])
    assert final["done"] is True
    assert final["draft_accepted"] == final["draft_proposed"] > 0


def _wait_ready(url: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/status").json()
        if status["status"] == "ready":
            return status
        time.sleep(0.05)
    raise AssertionError("runner did not load")
