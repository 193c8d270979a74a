"""The prefix cache: a second chat turn reuses the first turn's KV cache (prompt and answer),
evaluates only the new tokens and produces what a cold prefill would; diverging prompts reuse
only the shared prefix; the byte budget evicts least recently used entries."""

from __future__ import annotations

import json
import time

import httpx
import mlx.core as mx
import mlx_models
import pytest
from conftest import serve_app

from runner.generate import Done, Generator
from runner.kv_cache import KVCache
from runner.prefix_cache import PrefixCache
from runner.sample import Options
from runner.server import build_app

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures
tiny = mlx_models.tiny

PROMPT = mlx_models.PROMPT
GREEDY = Options(temperature=0, num_predict=20)




def _generator(tiny, **kwargs) -> Generator:
    loaded, tokenizer = tiny
    return Generator(loaded.model, tokenizer, loaded.context_length, **kwargs)


def _turn(generator: Generator, prompt: list[int], options: Options = GREEDY
          ) -> tuple[list[int], Done]:
    pieces = list(generator.generate(prompt, options))
    done = pieces[-1]
    assert isinstance(done, Done)
    return generator.tokens, done


def test_second_turn_reuses_the_first_turn_and_matches_a_cold_prefill(tiny):
    warm = _generator(tiny)
    answer, first = _turn(warm, PROMPT)
    assert first.prompt_cached == 0 and first.prompt_eval_count == len(PROMPT)
    second_prompt = PROMPT + answer + [5, 77, 901, 2]
    warm_tokens, second = _turn(warm, second_prompt)
    cold_tokens, cold = _turn(_generator(tiny), second_prompt)
    # the whole first turn is in the cache except the last answer token, never fed back
    assert second.prompt_cached == len(PROMPT) + len(answer) - 1
    assert second.prompt_eval_count == len(second_prompt) - second.prompt_cached == 5
    assert cold.prompt_eval_count == len(second_prompt) and cold.prompt_cached == 0
    assert warm_tokens == cold_tokens


def test_reused_cache_gives_the_logits_of_a_cold_forward(tiny):
    loaded, _ = tiny
    generator = _generator(tiny)
    answer, _ = _turn(generator, PROMPT)
    prompt = PROMPT + answer[:10] + [44, 45]
    match = generator.prefix_cache.begin(prompt, generator.make_caches)
    assert match.length == len(PROMPT) + 10
    warm = loaded.model(mx.array(prompt[match.length:])[None], match.caches)[0, -1]
    cold = loaded.model(mx.array(prompt)[None], [KVCache() for _ in loaded.model.layers])[0, -1]
    assert mx.allclose(warm, cold, atol=1e-4).item()
    assert mx.argmax(warm).item() == mx.argmax(cold).item()


def test_a_full_match_still_evaluates_the_last_prompt_token(tiny):
    generator = _generator(tiny)
    first_tokens, _ = _turn(generator, PROMPT)
    again_tokens, again = _turn(generator, PROMPT)
    assert again.prompt_cached == len(PROMPT) - 1 and again.prompt_eval_count == 1
    assert again_tokens == first_tokens


def test_a_diverging_prompt_reuses_only_the_common_prefix(tiny):
    generator = _generator(tiny)
    first, _ = _turn(generator, PROMPT)
    other = [*PROMPT[:5], 900, 901, 902, 903]
    other_tokens, done = _turn(generator, other)
    assert done.prompt_cached == 5 and done.prompt_eval_count == 4
    cold_tokens, _ = _turn(_generator(tiny), other)
    assert other_tokens == cold_tokens
    # the shared prefix and one branch per continuation
    assert sorted(len(n.tokens) for n in generator.prefix_cache.nodes()) == sorted(
        [5, len(other) - 5 + len(other_tokens) - 1, len(PROMPT) - 5 + len(first) - 1])


def test_a_longer_sequence_extends_the_node_it_continues():
    cache = PrefixCache()
    _store(cache, [1, 2, 3])
    _store(cache, [1, 2, 3, 4, 5])
    _store(cache, [1, 9])
    assert sorted(n.tokens for n in cache.nodes()) == [(1,), (2, 3, 4, 5), (9,)]
    assert cache.begin([1, 2, 3, 4, 5, 6], _fresh).length == 5


def test_byte_budget_evicts_the_least_recently_used_sequence():
    one_entry = _stored_bytes(4)
    cache = PrefixCache(budget_bytes=2 * one_entry)
    _store(cache, [1, 2, 3, 4])
    _store(cache, [5, 6, 7, 8])
    assert cache.begin([1, 2, 3, 4, 0], _fresh).length == 4  # touches the first
    _store(cache, [9, 9, 9, 9])  # over budget: the second goes
    assert len(cache) == 2 and cache.nbytes <= cache.budget_bytes
    assert cache.begin([5, 6, 7, 8, 0], _fresh).length == 0
    assert cache.begin([1, 2, 3, 4, 0], _fresh).length == 4
    tiny = PrefixCache(budget_bytes=one_entry // 2)
    _store(tiny, [1, 2, 3, 4])
    assert len(tiny) == 0


def test_a_tiny_budget_means_no_reuse_across_turns(tiny):
    generator = _generator(tiny, prefix_cache=PrefixCache(budget_bytes=1024))
    answer, _ = _turn(generator, PROMPT)
    _, second = _turn(generator, PROMPT + answer + [5])
    assert second.prompt_cached == 0 and len(generator.prefix_cache) == 0


def test_runner_reports_fewer_evaluated_tokens_on_the_second_turn(model_store, created_model):
    app = build_app(model_store, created_model("llama"), "float32")
    with serve_app(app) as url:
        _wait_ready(url)
        turn = [{"role": "user", "content": "hello there"}]
        first, text = _complete(url, turn)
        turn += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        second, _ = _complete(url, turn)
    assert first["prompt_cached"] == 0
    # the whole first prompt and the answer's tokens (as re-rendered) come from the cache
    assert second["prompt_cached"] > first["prompt_eval_count"]
    assert second["prompt_eval_count"] < first["prompt_eval_count"] + 8


def _fresh() -> list[KVCache]:
    return [KVCache(), KVCache()]


def _store(cache: PrefixCache, tokens: list[int]) -> None:
    """What a request for `tokens` leaves behind (all of them in the caches)."""
    match = cache.begin(tokens, _fresh)
    for layer in match.caches:
        new = len(tokens) - layer.offset
        layer.update_and_fetch(mx.ones((1, 2, new, 8)), mx.ones((1, 2, new, 8)))
    cache.close(tokens, match)


def _stored_bytes(length: int) -> int:
    return 2 * 2 * (2 * length * 8 * 4)  # layers x (keys, values) x float32 elements


def _complete(url: str, messages: list[dict]) -> tuple[dict, str]:
    body = {"messages": messages, "options": {"temperature": 0, "num_predict": 8}}
    lines = [json.loads(line) for line in
             httpx.post(f"{url}/v1/completions", json=body, timeout=60).text.splitlines()]
    assert lines[-1]["done"] is True, lines[-1]
    return lines[-1], "".join(line["content"] for line in lines[:-1])


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/status").json()["status"] != "ready":
        assert time.monotonic() < deadline, "runner did not load"
        time.sleep(0.05)


def test_a_prefill_cancelled_halfway_leaves_a_cache_the_next_request_can_trust(tiny):
    calls = iter(range(1000))
    generator = _generator(tiny, prefill_chunk=4)
    prompt = [*PROMPT, 11, 12, 13, 14, 15, 16]
    pieces = list(generator.generate(prompt, GREEDY, cancelled=lambda: next(calls) >= 2))
    assert pieces[-1].eval_count == 0
    again_tokens, again = _turn(generator, prompt)
    assert again.prompt_cached == 8  # the two chunks that ran
    cold_tokens, _ = _turn(_generator(tiny), prompt)
    assert again_tokens == cold_tokens


def test_the_budget_comes_from_ferry_prefix_cache_bytes(model_store, created_model):
    from ferry.config import ConfigError, Settings

    settings = Settings.from_env({"FERRY_PREFIX_CACHE_BYTES": "123456"})
    assert Settings.from_env({}).prefix_cache_bytes == 1 << 30
    with pytest.raises(ConfigError, match="FERRY_PREFIX_CACHE_BYTES"):
        Settings.from_env({"FERRY_PREFIX_CACHE_BYTES": "lots"})
    app = build_app(model_store, created_model("llama"), "float32",
                    prefix_cache_bytes=settings.prefix_cache_bytes)
    with serve_app(app) as url:
        _wait_ready(url)
        _complete(url, [{"role": "user", "content": "hello there"}])
        status = httpx.get(f"{url}/v1/status").json()["prefix_cache"]
    assert status["budget"] == 123456 and 0 < status["bytes"] <= 123456
