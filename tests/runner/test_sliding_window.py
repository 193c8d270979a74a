"""Sliding-window layers keep only their window (gemma3's local layers, mistral with
`sliding_window`): prompts longer than the window and prefill chunks smaller than the prompt
still match mlx-lm (gemma3) and the full-cache path (mistral), the windowed caches stay at the
window however long the generation, the prefix-cache trie resumes them correctly, and
speculative decoding steps aside for them."""

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
from runner.generate import Done, Generator
from runner.kv_cache import KVCache, SlidingWindowCache, new_caches
from runner.load import load_model
from runner.sample import Options
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture
WINDOW = 8  # the fixtures' sliding window
LONG = [(37 * i + 11) % 1900 + 5 for i in range(29)]  # well past the window


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, make_checkpoint) -> dict[str, Path]:
    tokenizer = Path(make_checkpoint("llama"))
    return {"gemma3": write_checkpoint(tmp_path_factory.mktemp("sw-gemma3"), "gemma3",
                                       tokenizer),
            "mistral": write_checkpoint(tmp_path_factory.mktemp("sw-mistral"), "mistral",
                                        tokenizer, sliding_window=WINDOW)}


@pytest.fixture(scope="module")
def loaded(model_store, checkpoints):
    made = {}
    for arch, path in checkpoints.items():
        name = f"test/sw-{arch}"
        create(Name.parse(name), path, CreateOptions(), model_store, lambda event: None,
               threading.Event())
        model = load_model(model_store, name, "float32")
        tokenizer = ModelTokenizer(model.files.files, model.files.config)
        tokenizer.eos_ids.clear()  # random weights: never stop early
        made[arch] = model, tokenizer
    return made


def _greedy(generator: Generator, prompt: list[int], n: int) -> tuple[list[int], Done]:
    *_, done = generator.generate(prompt, Options(temperature=0, num_predict=n))
    assert isinstance(done, Done) and done.eval_count == n
    return generator.tokens, done


def _chunked_logits(model, prompt: list[int], chunk: int, caches) -> mx.array:
    for start in range(0, len(prompt) - 1, chunk):
        model(mx.array([prompt[start:min(start + chunk, len(prompt) - 1)]]), caches)
    return model(mx.array([prompt[-1:]]), caches)[0, -1]


@pytest.mark.parametrize("chunk", [3, WINDOW, 13, 64])
def test_gemma3_chunked_prefill_past_the_window_matches_mlx_lm(loaded, checkpoints, chunk):
    model = loaded["gemma3"][0].model
    reference, _ = mlx_lm.load(str(checkpoints["gemma3"]))
    reference.set_dtype(mx.float32)
    expected = reference(mx.array([LONG]))[0, -1]
    ours = _chunked_logits(model, LONG, chunk, new_caches(model))
    assert mx.abs(ours - expected).max().item() <= 1e-3


@pytest.mark.parametrize("chunk", [5, 16])
def test_gemma3_greedy_past_the_window_identical_to_mlx_lm(loaded, checkpoints, chunk):
    (model, tokenizer) = loaded["gemma3"]
    generator = Generator(model.model, tokenizer, model.context_length, prefill_chunk=chunk)
    tokens, _ = _greedy(generator, LONG, 40)
    reference, _ = mlx_lm.load(str(checkpoints["gemma3"]))
    reference.set_dtype(mx.float32)
    expected = [int(step[0]) for step in generate_step(mx.array(LONG), reference,
                                                       max_tokens=40)]
    assert tokens == expected


def _full_cache_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: every layer keeps the whole history, the window applied as a mask."""
    caches = [KVCache() for _ in model.layers]
    logits = model(mx.array([prompt]), caches)[0, -1]
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([out[-1:]]), caches)[0, -1]
    return out


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_generation_past_the_window_equals_the_full_cache_path(loaded, arch):
    model, tokenizer = loaded[arch]
    generator = Generator(model.model, tokenizer, model.context_length, prefill_chunk=6)
    tokens, _ = _greedy(generator, LONG[:12], 48)
    assert tokens == _full_cache_greedy(model.model, LONG[:12], 48)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windowed_layers_stay_at_the_window(loaded, arch):
    model = loaded[arch][0].model
    caches = new_caches(model)
    windowed = [c for c in caches if isinstance(c, SlidingWindowCache)]
    assert len(windowed) == (2 if arch == "gemma3" else 4)  # gemma3: every other layer
    _chunked_logits(model, LONG, 16, caches)
    token = mx.array([[5]])
    sizes = []
    for _ in range(60):
        model(token, caches)
        mx.eval([c.state for c in caches])
        sizes.append(max(c.keys.shape[2] for c in windowed))
    per_position = windowed[0].nbytes() // windowed[0].keys.shape[2]
    assert max(sizes) == WINDOW and all(c.held == WINDOW for c in windowed)
    assert all(c.nbytes() == WINDOW * per_position for c in windowed)
    assert all(c.offset == len(LONG) + 60 for c in caches)
    full = [c for c in caches if isinstance(c, KVCache)]
    assert all(c.offset == len(LONG) + 60 for c in full)  # gemma3's global layers keep all


def test_sliding_cache_snapshot_survives_later_writes():
    """A restored snapshot is the trie's own array: decode must not write into it."""
    cache = SlidingWindowCache(4)
    keys = mx.random.normal((1, 2, 9, 3))
    cache.update_and_fetch(keys[..., :5, :], keys[..., :5, :])
    for i in range(5, 9):
        cache.update_and_fetch(keys[..., i:i + 1, :], keys[..., i:i + 1, :])
    snapshot = cache.snapshot()
    assert mx.array_equal(snapshot[0], keys[..., 5:9, :]).item() and snapshot[2] == 9
    kept = mx.array(snapshot[0])
    again = SlidingWindowCache(4)
    again.restore(snapshot)
    for _ in range(3):
        again.update_and_fetch(keys[..., :1, :], keys[..., :1, :])
    mx.eval(again.state)
    assert mx.array_equal(snapshot[0], kept).item()


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_prefix_cache_next_turn_matches_a_cold_run(loaded, arch):
    model, tokenizer = loaded[arch]
    warm = Generator(model.model, tokenizer, model.context_length, prefill_chunk=7)
    answer, _ = _greedy(warm, LONG[:11], 12)
    second = LONG[:11] + answer + [44, 45, 46]
    match = warm.prefix_cache.begin(second, warm.make_caches)
    assert match.length > WINDOW  # resumed from a checkpoint past the window
    warm.prefill(match)
    logits = model.model(mx.array([second[-1:]]), match.caches)[0, -1]
    cold = model.model(mx.array([second]))[0, -1]
    assert mx.abs(logits - cold).max().item() <= 1e-4
    warm.prefix_cache.close(second, match)
    tokens, done = _greedy(warm, [*second, 47], 10)  # a third turn, through generate
    cold_tokens, _ = _greedy(Generator(model.model, tokenizer, model.context_length),
                             [*second, 47], 10)
    assert done.prompt_cached > WINDOW and tokens == cold_tokens


def test_speculative_decoding_steps_aside_for_windowed_caches(loaded):
    model, tokenizer = loaded["gemma3"]
    generator = Generator(model.model, tokenizer, model.context_length, draft=model.model)
    assert len(generator.make_caches()) == generator.target_layers  # no draft caches
    assert not generator.drafting  # what /v1/status reports as "draft"
    tokens, _ = _greedy(generator, LONG[:12], 16)
    assert tokens == _full_cache_greedy(model.model, LONG[:12], 16)
