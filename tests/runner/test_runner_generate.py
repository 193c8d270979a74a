"""The decode loop: seeds, stop strings, num_predict, context limits, the release rule, and
memory that stays flat over a long generation."""

from __future__ import annotations

import mlx_models
import psutil
import pytest

from runner.generate import (
    ContextError,
    Done,
    Generator,
    ReleasePolicy,
    StopFilter,
    fit_prompt,
)
from runner.load import load_model
from runner.sample import Options

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures
tiny = mlx_models.tiny

PROMPT = mlx_models.PROMPT




def _run(tiny, options: Options, prompt=PROMPT, **kwargs) -> tuple[list[str], Done]:
    loaded, tokenizer = tiny
    generator = Generator(loaded.model, tokenizer, loaded.context_length, **kwargs)
    pieces = list(generator.generate(prompt, options))
    done = pieces.pop()
    assert isinstance(done, Done)
    return pieces, done


def test_same_seed_same_text_other_seed_other_text(tiny):
    first, _ = _run(tiny, Options(seed=7, num_predict=40, temperature=1.0))
    again, _ = _run(tiny, Options(seed=7, num_predict=40, temperature=1.0))
    other, _ = _run(tiny, Options(seed=8, num_predict=40, temperature=1.0))
    assert "".join(first) == "".join(again)
    assert "".join(first) != "".join(other)


def test_num_predict_limits_tokens_and_reports_length(tiny):
    _, done = _run(tiny, Options(seed=1, num_predict=17))
    assert (done.eval_count, done.reason, done.prompt_eval_count) == (17, "length", len(PROMPT))
    assert done.prompt_eval_duration > 0 and done.eval_duration > 0


def test_stop_string_across_token_boundary_is_cut_and_never_emitted(tiny):
    options = Options(temperature=0, num_predict=48)
    pieces, _ = _run(tiny, options)
    text = "".join(pieces)
    # a stop string made of the end of one streamed piece and the start of the next
    boundary = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = text[boundary - 2:boundary + 2]
    assert len(stop) == 4
    cut, done = _run(tiny, Options(temperature=0, num_predict=48, stop=(stop,)))
    assert "".join(cut) == text[:text.index(stop)]
    assert all(stop not in piece for piece in cut)
    assert done.reason == "stop"


def test_stop_filter_holds_back_partial_matches():
    stops = StopFilter(("</end>",))
    assert stops.feed("hello </") == ("hello ", False)
    assert stops.feed("en") == ("", False)
    assert stops.feed("x more") == ("</enx more", False)
    assert stops.feed(" </e") == (" ", False)
    assert stops.feed("nd> tail") == ("", True)


def test_repeat_penalty_changes_greedy_output(tiny):
    plain, _ = _run(tiny, Options(temperature=0, num_predict=40))
    penalized, _ = _run(tiny, Options(temperature=0, num_predict=40, repeat_penalty=1.5))
    assert "".join(plain) != "".join(penalized)


def test_release_after_prefill_chunks_each_256_crossing_and_at_end(tiny):
    calls: list[int] = []
    loaded, tokenizer = tiny
    generator = Generator(loaded.model, tokenizer, loaded.context_length,
                          release=lambda: calls.append(generator.generated), prefill_chunk=64)
    prompt = (PROMPT * 20)[:200]  # 199 prefilled tokens: 4 chunks of 64
    pieces = list(generator.generate(prompt, Options(seed=3, num_predict=600)))
    assert pieces[-1].eval_count == 600
    assert calls == [0, 0, 0, 0, 256, 512, 600]


def test_release_policy_counts_a_multi_token_round_that_steps_over_a_boundary():
    calls: list[int] = []
    policy = ReleasePolicy(lambda: calls.append(policy.count))
    for n in (250, 5, 3, 250, 10, 1):  # 250, 255, 258 | 508, 518, 519
        policy.generated(n)
    assert calls == [258, 518]
    policy.generated(600)  # one round over two boundaries: one release
    assert calls == [258, 518, 1119]


def test_prompt_longer_than_context_truncates_or_errors(tiny):
    long_prompt = (PROMPT * 30)[:300]
    _, done = _run(tiny, Options(num_ctx=128, num_predict=4, seed=0), prompt=long_prompt)
    assert done.prompt_eval_count == 127
    with pytest.raises(ContextError, match="300 tokens"):
        fit_prompt(long_prompt, 128, truncate=False)


def test_generation_stops_when_the_context_is_full(tiny):
    _, done = _run(tiny, Options(num_ctx=64, seed=0), prompt=PROMPT)
    assert (done.eval_count, done.reason) == (64 - len(PROMPT), "length")


def test_rss_stays_flat_over_1500_tokens_after_the_first_256(tiny):
    loaded, tokenizer = tiny
    process = psutil.Process()
    samples: dict[int, int] = {}
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    for _ in generator.generate(PROMPT, Options(seed=5, num_predict=1500)):
        if generator.generated >= 256 and generator.generated % 50 == 0:
            samples[generator.generated] = process.memory_info().rss
    assert generator.generated == 1500
    baseline = samples[min(samples)]
    assert max(samples.values()) - baseline < 32 * 1024 * 1024, samples


def test_load_releases_the_buffer_pool_once_weights_are_evaluated(model_store, created_model):
    calls: list[str] = []
    loaded = load_model(model_store, created_model("llama"), "float32",
                        release=lambda: calls.append("release"))
    assert calls == ["release"]
    assert loaded.weights_bytes > 0
