"""The prefix-cache trie on a hybrid model (Mamba2 + attention + sliding-window layers): every
request's logits equal a cold forward's, whatever was reused, split, merged or evicted before.

Media spans are derived from the tokens, as a vision model's placeholders are: a run of MEDIA
tokens of one value is one item evaluated in one non-causal forward; answers never contain them.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence

import mlx.core as mx
import pytest
from hybrid_model import HybridModel

from runner.generate import Generator
from runner.prefix_cache import VIEW_SLACK, Match, PrefixCache

MEDIA = 240  # token ids from here on are media placeholders
ITEM = 5  # tokens per media item


def spans_of(tokens: Sequence[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, token in enumerate([*tokens, -1]):
        if start is not None and token != tokens[start]:
            if i - start > 1:
                spans.append((start, i))
            start = None
        if start is None and token >= MEDIA:
            start = i
    return spans


class Driver:
    """Requests as the runner makes them (begin, chunked prefill, decode, close), greedy."""

    def __init__(self, model: HybridModel, budget: int, chunk: int = 8) -> None:
        self.model = model
        self.cache = PrefixCache(budget)
        self.generator = Generator(model, None, 4096, release=lambda: None,  # type: ignore[arg-type]
                                   prefill_chunk=chunk, prefix_cache=self.cache)

    def request(self, prompt: list[int], answer: int = 4,
                rank: int = 0) -> tuple[mx.array, list[int], Match]:
        """`rank`: the answer starts with the rank-th likeliest token (a sampled answer)."""
        match = self.cache.begin(prompt, self.model.make_cache, spans_of(prompt))
        self.generator.prefill(match)
        logits = self.model(mx.array([prompt[-1:]]), match.caches)[0, -1]
        first, out = logits, []
        for i in range(answer):
            order = mx.argsort(-logits[:MEDIA])
            token = int(order[rank if i == 0 else 0].item())
            out.append(token)
            if i + 1 < answer:
                logits = self.model(mx.array([[token]]), match.caches)[0, -1]
        self.cache.close(prompt + out, match)
        return first, out, match

    def cold(self, prompt: list[int]) -> mx.array:
        return self.model(mx.array([prompt]), spans=spans_of(prompt))[0, -1]

    def check(self, prompt: list[int], answer: int = 4,
              rank: int = 0) -> tuple[list[int], Match]:
        logits, out, match = self.request(prompt, answer, rank)
        assert mx.allclose(logits, self.cold(prompt), atol=1e-3).item(), (prompt, match.length)
        assert self.cache.nbytes <= self.cache.budget_bytes
        return out, match


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel("M*W-M*")


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, MEDIA) for _ in range(n)]


def _item(rng: random.Random) -> list[int]:
    return [rng.randrange(MEDIA, 256)] * ITEM


def _turn_bytes(model: HybridModel, prompt: list[int], view_slack: float = VIEW_SLACK) -> int:
    driver = Driver(model, 1 << 40)
    driver.cache.view_slack = view_slack
    driver.request(prompt)
    return driver.cache.nbytes


def test_fifty_turns_of_one_question_stay_within_a_small_budget(model):
    rng = random.Random(0)
    question = [1, 2, 3, *_words(rng, 12)]
    budget = 4 * _turn_bytes(model, question)
    driver = Driver(model, budget)
    sizes, counts = [], []
    for turn in range(50):  # each a different (sampled) answer: a new branch every turn
        _, match = driver.check(question, answer=rng.randrange(2, 10), rank=rng.randrange(20))
        if turn:
            assert match.length > 0  # the question itself is always reused
        sizes.append(driver.cache.nbytes)
        counts.append(len(driver.cache))
    assert max(sizes) <= budget
    reached = next(i for i, s in enumerate(sizes) if s > budget // 2)
    assert reached < 25 and max(counts[reached:]) <= 2 * counts[reached] + 2  # flat


def test_resume_inside_an_edge_survives_eviction_pressure_and_hits(model):
    rng = random.Random(1)
    driver = Driver(model, 1 << 40)
    stored = _words(rng, 30)
    driver.check(stored)
    branch = stored[:17] + _words(rng, 6)
    _, match = driver.check(branch)
    assert match.length == 0 and 17 in match.captures  # no checkpoint yet: capture at the match
    head = next(n for n in driver.cache.nodes() if n.end == 17)
    assert head.state is not None and len(head.children) == 2
    unused_tail = head.children[stored[17]]
    driver.cache.budget_bytes = driver.cache.nbytes - unused_tail.nbytes()
    driver.check(_words(rng, 3))  # pressure: a small unrelated request
    assert stored[17] not in head.children  # the unused tail went, the head stayed
    again = stored[:17] + _words(rng, 4)
    _, match = driver.check(again)
    assert match.length == 17


def test_a_response_that_is_a_prefix_of_a_stored_one_lands_on_the_split_head(model):
    rng = random.Random(2)
    driver = Driver(model, 1 << 40)
    prompt = _words(rng, 20)
    long_answer, _ = driver.check(prompt, answer=12)
    short_answer, _ = driver.check(prompt, answer=5)
    assert short_answer == long_answer[:5]
    end = len(prompt) + 4  # the last answer token is never fed
    head = next(n for n in driver.cache.nodes() if n.end == end)
    assert head.state is not None and driver.cache.frontier is head
    assert len(head.children) == 1  # the longer response's tail is still there
    follow = prompt + short_answer + _words(rng, 3)
    _, match = driver.check(follow)
    assert match.length == end


def test_rewinding_to_a_merged_away_turn_resumes_at_the_newest_checkpoint_before_it(model):
    rng = random.Random(6)
    driver = Driver(model, 1 << 40)
    prompt = _words(rng, 20)
    for _ in range(3):
        answer, _ = driver.check(prompt)
        prompt = prompt + answer + _words(rng, 5)
    ends = sorted(n.end for n in driver.cache.nodes())
    driver.cache.resize(driver.cache.nbytes - 1)  # one eviction: the deepest non-frontier node
    assert driver.cache.events["merge"] == 1
    survivors = sorted(n.end for n in driver.cache.nodes())
    (gone,) = set(ends) - set(survivors)
    rewind = prompt[:gone + 2] + _words(rng, 3)  # diverges just past the merged-away point
    _, match = driver.check(rewind)
    assert match.length == max(e for e in survivors if e < gone)


@pytest.mark.parametrize("pattern", ["M*W-M*", "*-*"])
def test_a_match_ending_inside_a_span_resumes_at_its_start(pattern):
    model = HybridModel(pattern)
    rng = random.Random(3)
    driver = Driver(model, 1 << 40)
    text, item = _words(rng, 12), _item(rng)
    driver.check(text + item[:3] + [9], answer=1)  # stored: the item's first 3 tokens only
    prompt = text + item + _words(rng, 4)
    assert spans_of(prompt) == [(12, 12 + ITEM)]
    _, match = driver.check(prompt)
    if pattern == "*-*":
        assert match.length == 12  # matched 15, inside the span: back to its start
    else:
        assert match.length <= 12 and 12 in match.captures


def test_prefill_chunks_never_end_inside_a_span():
    match = Match(0, [], list(range(40)), ((6, 14), (20, 23)), captures=[10, 21])
    chunks = list(match.chunks(39, 8))
    assert chunks[0] == (0, 6) and (6, 14) in chunks
    ends = [stop for _, stop in chunks]
    assert all(not (a < e < b) for e in ends for a, b in ((6, 14), (20, 23)))
    assert ends[-1] == 39 and all(b - a > 0 for a, b in chunks)


def _next_prompt(rng: random.Random, history: list[list[int]]) -> list[int]:
    """A new conversation, a next turn, an edit of an earlier turn, a rewind or a retry."""
    action = rng.choice(["new", "next", "next", "edit", "rewind", "retry"]) if history else "new"
    if action == "new":
        body = [1, 2, 3, *_words(rng, rng.randrange(4, 20))]  # a shared system prefix
    else:
        base = rng.choice(history)
        if action == "next":
            body = base + _words(rng, rng.randrange(1, 6))
        elif action == "edit":
            cut = rng.randrange(1, len(base))
            while cut > 0 and base[cut - 1] >= MEDIA:
                cut -= 1  # edits keep media items whole
            body = base[:max(cut, 1)] + _words(rng, rng.randrange(1, 8))
        else:
            return rng.choice(history)  # rewind to (or retry) an earlier prompt
    if rng.random() < 0.4:
        body = body + _item(rng) + _words(rng, rng.randrange(0, 4))
    return body + _words(rng, 1)  # the last token is never media


@pytest.mark.parametrize("seed,view_slack", [(0, VIEW_SLACK), (1, VIEW_SLACK),
                                              (2, float("inf")), (3, float("inf"))])
def test_random_conversations_under_tight_budgets_match_cold_runs(model, seed, view_slack):
    """`view_slack` inf: the active path is always views of the live buffers, however short."""
    rng = random.Random(seed)
    budget = _turn_bytes(model, list(range(5, 45)), view_slack)
    driver = Driver(model, budget, chunk=rng.choice([4, 8, 16]))
    driver.cache.view_slack = view_slack
    history: list[list[int]] = []
    hits = 0
    for _ in range(30):
        prompt = _next_prompt(rng, history)
        answer, match = driver.check(prompt, answer=rng.randrange(1, 6))
        hits += match.length > 0
        history.append(prompt + answer)
        driver.cache.budget_bytes = rng.choice([budget // 2, budget, 2 * budget])
    events = driver.cache.events
    assert hits >= 8 and events["split"] >= 10 and events["evict"] >= 10, (hits, events)
    assert events["merge"] >= 3, events


def test_a_second_long_request_peaks_no_higher_than_the_first_plus_the_stored_bytes(model):
    rng = random.Random(4)
    driver = Driver(model, 1 << 40, chunk=256)
    first = _words(rng, 1500)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    answer = driver.request(first, answer=8)[1]  # the match is not kept: closed, it is the trie's
    first_peak = mx.get_peak_memory() - base
    stored = driver.cache.nbytes
    for second in (first + answer + _words(rng, 20), _words(rng, 1500)):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        driver.request(second, answer=8)
        assert mx.get_peak_memory() - base <= first_peak + stored, (first_peak, stored)
        stored = driver.cache.nbytes


def test_the_bytes_reported_are_the_bytes_held(model):
    rng = random.Random(5)
    driver = Driver(model, 1 << 40, chunk=512)
    mx.eval(model.parameters())
    gc.collect()  # arrays an earlier test left in reference cycles must not be freed mid-test
    mx.clear_cache()
    before = mx.get_active_memory()
    for _ in range(3):
        driver.request(_words(rng, 1000), answer=4)  # branches of long prompts, checkpoints
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    assert driver.cache.nbytes <= held <= driver.cache.nbytes * 1.1 + (1 << 16)


def test_the_active_path_is_views_of_the_live_buffers_and_a_divergence_copies_the_tail(model):
    rng = random.Random(7)
    driver = Driver(model, 1 << 40, chunk=64)
    cache = driver.cache
    prompt = _words(rng, 480)  # the live buffers (512 positions) are tight: no copies
    answer, first = driver.check(prompt)
    live = [c for c in first.caches if c.rewindable]
    turn = prompt + answer + _words(rng, 5)
    answer2, second = driver.check(turn)
    assert all(a is b for a, b in zip(live, (c for c in second.caches if c.rewindable),  # same
                                      strict=True))
    path = [n for n in cache.nodes() if n.viewed]
    assert path and all(n.kv == [] for n in path)
    assert max(n.end for n in path) == len(turn) + len(answer2) - 1
    states = sum(n.nbytes() for n in cache.nodes())  # views hold only their checkpoints
    assert cache.nbytes == states + sum(c.nbytes() for c in live)  # the buffers, once
    edit = prompt[:200] + _words(rng, 4)  # diverges inside the first turn's edge
    driver.check(edit)
    tail = [n for n in cache.nodes() if n.start >= 200 and not n.viewed]
    assert tail and all(n.kv for n in tail)  # the old path past the edit: copied out
    _, match = driver.check(turn)  # back to the second turn: a hit, logits as cold
    assert match.length > 200
