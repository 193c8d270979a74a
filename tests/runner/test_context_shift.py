"""Context shift (Ollama's: keep num_keep tokens, drop the older half of the rest, go on) and
num_predict -1 (until the context is full)."""

from __future__ import annotations

import mlx_models

from runner.generate import Done, Generator, shifted
from runner.sample import Options

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures
tiny = mlx_models.tiny
PROMPT = mlx_models.PROMPT  # 12 tokens


def _generate(tiny, prompt, options, **kwargs) -> tuple[Generator, Done]:
    loaded, tokenizer = tiny
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    done = list(generator.generate(prompt, options, **kwargs))[-1]
    assert isinstance(done, Done)
    return generator, done


def test_shift_keeps_num_keep_and_drops_the_older_half():
    assert shifted(list(range(20)), 4) == [0, 1, 2, 3, *range(12, 20)]
    assert shifted([1, 2, 3], 10) == [1, 2, 3]  # too short to drop anything


def test_generation_past_num_ctx_shifts_and_continues_as_from_the_shifted_text(tiny):
    options = Options(temperature=0, num_ctx=32, num_predict=30)
    generator, done = _generate(tiny, PROMPT, options)
    assert (done.eval_count, done.reason) == (30, "length") and generator.shifted
    answer = generator.tokens
    # 20 tokens fill the context; the rest continues from the shifted sequence
    restart = shifted(PROMPT + answer[:20], options.num_keep)
    fresh, _ = _generate(tiny, restart, Options(temperature=0, num_predict=10))
    assert answer[20:] == fresh.tokens


def test_shift_off_stops_at_the_full_context_and_minus_one_fills_it(tiny):
    _, stopped = _generate(tiny, PROMPT, Options(temperature=0, num_ctx=32, num_predict=30),
                           shift=False)
    assert (stopped.eval_count, stopped.reason) == (20, "length")
    _, full = _generate(tiny, PROMPT, Options(temperature=0, num_ctx=40, num_predict=-1))
    assert (full.eval_count, full.reason) == (40 - len(PROMPT), "length")
