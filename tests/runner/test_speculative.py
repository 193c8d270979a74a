"""Speculative decoding: a draft loaded from the model's `draft.` layers, greedy output equal to
plain decoding token for token, full acceptance when the draft is the target itself, seeded
sampling, and the release rule across rounds that emit several tokens."""

from __future__ import annotations

import json
import threading
import time

import httpx
import mlx.core as mx
import mlx_models
import pytest
from conftest import serve_app

from registry.names import Name
from runner.generate import Done, Generator
from runner.load import load_model
from runner.sample import Options
from runner.server import build_app
from runner.speculative import DepthControl, Speculator
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


def test_a_draft_that_is_mostly_rejected_gets_parked(model_store, drafted):
    loaded, tokenizer = _load(model_store, drafted(1))
    _, _, done = _generate(loaded, tokenizer, Options(temperature=0, num_predict=200))
    assert done.draft is not None and done.draft.accepted < done.draft.proposed
    assert done.draft.proposed < 200  # drafting every round would propose ~4 per token


def _next_round(control: DepthControl, budget: int = 1000) -> tuple[str, int]:
    """What `Speculator.rounds` runs next: a parked stretch of plain rounds, or one draft
    round of `control.depth` proposals."""
    parked = control.take_parked(budget)
    return ("plain", parked) if parked else ("draft", control.depth)


def test_depth_control_parks_a_failing_draft_probes_it_and_resumes():
    control = DepthControl(depth=4)
    rounds = []
    for _ in range(8):
        kind, count = _next_round(control)
        rounds.append((kind, count))
        if kind == "draft":
            control.observe(count, 0)
    assert rounds[:6] == [("draft", 4)] * 6  # parked after 6 misses
    assert rounds[6:8] == [("plain", 8), ("draft", 4)]  # then a probe, which fails too
    assert _next_round(control, budget=10) == ("plain", 10)  # a park never exceeds the budget
    assert _next_round(control) == ("plain", 6)  # a failed probe doubled the park (8 -> 16)
    for _ in range(3):
        control.observe(4, 4)  # the draft got good: drafting resumes at full depth
    assert [_next_round(control) for _ in range(3)] == [("draft", 4)] * 3


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
    prompt = (PROMPT * 20)[:200]  # 199 prefilled tokens: 4 chunks, target and draft together
    pieces = list(generator.generate(prompt, Options(temperature=0, num_predict=600)))
    assert pieces[-1].eval_count == 600
    assert calls[:4] == [0] * 4
    crossings = calls[4:-1]
    assert len(crossings) == 2 and calls[-1] == 600
    assert 256 < crossings[0] <= 260 and 512 < crossings[1] <= 516  # 5-token rounds


def test_runner_reports_the_draft_and_its_acceptance(model_store, drafted):
    app = build_app(model_store, drafted(0), "float32")
    with serve_app(app) as url:
        status = _wait_ready(url)
        assert status["draft"] is True and status["prefix_cache"]["entries"] == 0
        body = {"prompt": "hello", "options": {"temperature": 0, "num_predict": 12}}
        lines = httpx.post(f"{url}/v1/completions", json=body, timeout=60).text.splitlines()
        assert httpx.get(f"{url}/v1/status").json()["prefix_cache"]["entries"] == 1
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


def test_rejection_sampling_emits_the_targets_distribution():
    """Draft q far from target p: the first token of a round must still follow p."""
    p = mx.array([0.5, 0.3, 0.15, 0.05])
    q = mx.array([0.1, 0.2, 0.3, 0.4])
    options = Options(temperature=1.0, top_k=0, top_p=1.0, seed=3)
    speculator = Speculator(None, None, [], options)  # models unused by the acceptance step
    logits = mx.stack([mx.log(p), mx.log(p)])
    key, trials = mx.random.key(5), 3000
    drafts = mx.random.categorical(mx.log(q), shape=(trials,), key=key).tolist()
    counts = [0] * 4
    for d in drafts:
        _, accepted, following = speculator._accept_sampled(mx.array([d], dtype=mx.uint32),
                                                            q[None], logits)
        counts[d if accepted else following] += 1
    observed = [c / trials for c in counts]
    assert all(abs(o - e) < 0.03 for o, e in zip(observed, p.tolist(), strict=True)), observed


def test_a_second_turn_reuses_target_and_draft_caches(loaded_self):
    loaded, tokenizer = loaded_self
    options = Options(temperature=0, num_predict=24)
    warm = Generator(loaded.model, tokenizer, loaded.context_length, draft=loaded.draft)
    list(warm.generate(PROMPT, options))
    second = PROMPT + warm.tokens + [5, 77, 901]
    match = warm.prefix_cache.begin(second, warm.make_caches)
    draft = match.caches[warm.target_layers:]
    assert draft and draft[0].offset >= len(PROMPT) + 20
    *_, done = warm.generate(second, options)
    cold = Generator(loaded.model, tokenizer, loaded.context_length)
    list(cold.generate(second, options))
    # the draft caught up at the end of the first turn: target and draft level in the trie
    assert done.prompt_cached == len(PROMPT) + 23 and done.prompt_eval_count == 4
    assert warm.tokens == cold.tokens
    assert done.draft is not None and done.draft.accepted == done.draft.proposed > 0


def test_the_draft_steps_aside_when_logprobs_are_asked_for(loaded_self):
    from runner.logprobs import Logprob

    loaded, tokenizer = loaded_self
    generator = Generator(loaded.model, tokenizer, loaded.context_length, draft=loaded.draft)
    items = list(generator.generate(PROMPT, Options(temperature=0, num_predict=12),
                                    logprobs=2))
    done = items.pop()
    logprobs = [i for i in items if isinstance(i, Logprob)]
    assert done.draft is None and len(logprobs) == done.eval_count == 12
    plain = Generator(loaded.model, tokenizer, loaded.context_length)
    list(plain.generate(PROMPT, Options(temperature=0, num_predict=12)))
    assert generator.tokens == plain.tokens  # same greedy answer, logprobs or not
