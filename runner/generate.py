"""The decode loop: prompt -> prefill in 2048-token chunks (64 on a CPU's native path, see
`prefill_chunk`) -> pipelined decode -> text pieces.

No HTTP here. `Generator.generate` yields text pieces (already cut at stop strings, never a
split UTF-8 character) and ends with one `Done` carrying Ollama's counters. Decode is pipelined
as in mlx-lm: the graph for token n+1 is built and handed to `mx.async_eval` before token n is
read back, so Python overhead overlaps with compute.

Memory rule (DESIGN.md, reference 3.3): MLX's buffer pool is released after every prefill
chunk, whenever the generated count crosses a multiple of 256 (a round that emits several tokens
and steps over a boundary counts once), and at the end of every request. The release function is
injected so that tests can record the calls.

Across requests the caches are kept in a `PrefixCache`: a prompt that starts with tokens
computed before (a chat's next turn) reuses them and only the rest is evaluated, which is what
`prompt_eval_count` then counts. With a draft model, or a model's own MTP head
(runner/mtp_draft.py), decode runs in speculative rounds (runner/speculative.py) unless the
repeat penalty is on (it depends on each emitted token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from runner.constrain import TokenConstraint
from runner.kv_cache import Cache, new_caches
from runner.logprobs import Logprob, LogprobSink
from runner.mtp_draft import MTPDrafter, feed
from runner.prefix_cache import Match, PrefixCache, Span
from runner.readback import token_id
from runner.sample import Options, Sampler
from runner.speculative import DepthControl, Drafter, DraftStats, ModelDrafter, Speculator
from runner.tokenizer import ModelTokenizer

PREFILL_CHUNK = 2048
CPU_NATIVE_PREFILL_CHUNK = 64  # see `prefill_chunk`
RELEASE_EVERY = 256
DEFAULT_NUM_CTX = 4096


def prefill_chunk(compute: str) -> int:
    """Prompt tokens evaluated at once on a compute path (runner/load.py). On a CPU the native
    path's quantized matmuls gain nothing from more rows (the small fixture's Q4_0 GGUF: 15.8
    prompt tokens/s in chunks of 64, 15.3 in one of 256), while the chunk's activations and
    attention scores are the request's peak: 5.8 MiB in chunks of 64, 17.9 in one of 256.
    The float32 and fused paths hand prefill to BLAS, which wants the long chunks."""
    if compute == "native" and mx.default_device().type == mx.DeviceType.cpu:
        return CPU_NATIVE_PREFILL_CHUNK
    return PREFILL_CHUNK


class ContextError(ValueError):
    """The prompt does not fit the context and the request asked not to truncate it."""


@dataclass(frozen=True)
class Done:
    reason: str  # "stop" (EOS or stop string) or "length" (num_predict or context full)
    prompt_eval_count: int
    prompt_eval_duration: int  # ns
    eval_count: int
    eval_duration: int  # ns
    prompt_cached: int = 0  # prompt tokens taken from the prefix cache, not evaluated
    draft: DraftStats | None = None  # proposals made and kept, when a draft model ran


class ReleasePolicy:
    """Calls `release` when the generated count crosses a multiple of `every`."""

    def __init__(self, release: Callable[[], None], every: int = RELEASE_EVERY) -> None:
        self.release = release
        self.every = every
        self.count = 0

    def generated(self, n: int = 1) -> None:
        before, self.count = self.count, self.count + n
        if before // self.every != self.count // self.every:
            self.release()


class StopFilter:
    """Holds back text that could be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = max((_overlap(self.pending, s) for s in self.stops), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


def fit_prompt(tokens: list[int], num_ctx: int, truncate: bool) -> list[int]:
    """The prompt as it will run: at most num_ctx - 1 tokens, leaving room for one more."""
    if not tokens:
        raise ContextError("the prompt is empty")
    limit = max(num_ctx - 1, 1)
    if len(tokens) <= limit:
        return tokens
    if not truncate:
        raise ContextError(f"the prompt is {len(tokens)} tokens, more than the context "
                           f"length {num_ctx} allows (at most {limit}); set truncate to keep "
                           "its tail")
    return tokens[-limit:]


class Generator:
    """Generation for one loaded model; one request at a time (the server serializes)."""

    def __init__(self, model: nn.Module, tokenizer: ModelTokenizer, context_length: int,
                 release: Callable[[], None] = mx.clear_cache,
                 prefill_chunk: int = PREFILL_CHUNK, draft: nn.Module | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.release = release
        self.prefill_chunk = prefill_chunk
        self.draft = draft
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.depth_control = DepthControl()  # learned across requests, as in Ollama
        self.target_layers = len(new_caches(model))
        # without a draft model, the model's own MTP head (Nemotron-H) drafts, if it has one
        head = getattr(model, "draft_head", None)
        self.head = head() if draft is None and head is not None else None
        # Speculation takes back the rejected part of each verify pass: every target cache
        # must allow that (KV caches rewind, recurrent ones pick a recorded state; a sliding
        # window cannot), otherwise the draft is loaded but not used.
        # A draft model rewinds its own caches after each round: they must all be KV caches.
        self.drafting = (draft is not None or self.head is not None) and all(
            c.undoes_verify for c in new_caches(model)) and (
            draft is None or all(c.rewindable for c in new_caches(draft)))
        self._emission: Emission | None = None
        self._tap: Callable[[mx.array], None] | None = None  # hidden states' sink (MTP head)
        self._shift_to: tuple[int, int] | None = None  # (tokens to generate, num_ctx)
        self.shifted = False  # whether the current (or last) request shifted its context

    @property
    def generated(self) -> int:
        """Tokens emitted by the current (or last) request."""
        return self._emission.count if self._emission is not None else 0

    @property
    def tokens(self) -> list[int]:
        """Token ids the current (or last) request read back, EOS included."""
        return list(self._emission.read) if self._emission is not None else []

    def num_ctx(self, options: Options) -> int:
        if options.num_ctx is not None and options.num_ctx > 0:
            return min(options.num_ctx, self.context_length)
        return min(self.context_length, DEFAULT_NUM_CTX)

    def generate(self, prompt: list[int], options: Options,
                 cancelled: Callable[[], bool] = lambda: False,
                 truncate: bool = True, spans: Sequence[Span] = (),
                 constraint: TokenConstraint | None = None, logprobs: int | None = None,
                 shift: bool = True) -> Iterator[str | Logprob | Done]:
        """Text pieces, then Done; with `logprobs` (the number of alternatives, 0 for none)
        each emitted token's Logprob comes before its text. `spans`: [start, end) prompt
        ranges evaluated in one forward (non-causal media).

        A `num_predict` beyond what the context holds shifts the context when it fills (as
        Ollama: keep `num_keep` tokens, drop the older half of the rest) unless `shift` is off;
        -1 generates until the context is full."""
        num_ctx = self.num_ctx(options)
        fitted = fit_prompt(prompt, num_ctx, truncate)
        cut = len(prompt) - len(fitted)
        spans = [(a - cut, b - cut) for a, b in spans if a >= cut]
        budget = num_ctx - len(fitted)
        self._shift_to = None
        if options.num_predict >= 0:
            if shift and options.num_predict > budget and constraint is None:
                self._shift_to = (options.num_predict, num_ctx)
            budget = min(budget, options.num_predict)
        try:
            sink = LogprobSink(logprobs, self.tokenizer.decode) if logprobs is not None else None
            yield from self._run(fitted, options, budget, cancelled, spans, constraint, sink)
        finally:
            self.release()

    def make_caches(self) -> list[Cache]:
        """The target's caches, then the draft's (or the MTP head's) when one is used."""
        target = new_caches(self.model)
        if not self.drafting:
            return target
        if self.head is not None:
            return target + self.head.make_cache()
        return target + new_caches(self.draft)

    def _target(self, inputs: mx.array, cache: list[Cache]) -> mx.array:
        """The target's logits; its hidden states go to `_tap` when one is set."""
        if self._tap is None:
            return self.model(inputs, cache)
        logits, hidden = self.model.forward_hidden(inputs, cache)  # type: ignore[operator]
        self._tap(hidden)
        return logits  # type: ignore[no-any-return]

    def _drafter(self, caches: list[Cache]) -> Drafter:
        if self.head is not None:
            return MTPDrafter(self.model, self.head, caches)  # type: ignore[arg-type]
        assert self.draft is not None
        return ModelDrafter(self.draft, caches)  # type: ignore[arg-type]

    def prefill(self, match: Match, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Evaluate the prompt but its last token into `match.caches` (target and draft), in
        chunks that stop at the prefix cache's captures and never split a span."""
        target, draft = match.caches[:self.target_layers], match.caches[self.target_layers:]
        for start, stop in match.chunks(len(match.prompt) - 1, self.prefill_chunk):
            if cancelled():
                return
            chunk = mx.array(match.prompt[start:stop])[None]
            inside = [(a - start, b - start) for a, b in match.spans if start <= a and b <= stop]
            kwargs = {"spans": inside} if inside else {}
            # logits unused: only the caches are evaluated
            if draft and self.head is not None:
                # the head pairs the hidden state at t with token t+1 (in the prompt: stop is
                # at most its last index)
                _, hidden = self.model.forward_hidden(chunk, target, **kwargs)  # type: ignore[operator]
                feed(self.model, self.head, match.prompt[start + 1:stop + 1], hidden,
                     draft)  # type: ignore[arg-type]
            else:
                self.model(chunk, target, **kwargs)
                if draft and self.draft is not None:
                    self.draft(chunk, draft, **kwargs)
            mx.eval([c.state for c in match.caches])
            match.capture(stop)
            self.release()

    def _run(self, prompt: list[int], options: Options, budget: int,
             cancelled: Callable[[], bool], spans: Sequence[Span],
             constraint: TokenConstraint | None = None,
             sink: LogprobSink | None = None) -> Iterator[str | Logprob | Done]:
        started = time.perf_counter_ns()
        self.shifted = False
        match = self.prefix_cache.begin(prompt, self.make_caches, spans)
        self.prefill(match, cancelled)
        target, draft = match.caches[:self.target_layers], match.caches[self.target_layers:]
        sampler = Sampler(options)
        speculator = None
        # a request that does not speculate still keeps the MTP head's cache level with the
        # target's (the prefix cache keeps only what every layer holds): its hidden states are
        # collected and fed to the head once, at the end
        self._tap = None
        speculates = draft and constraint is None and not sampler.uses_history and sink is None
        tap = MTPDrafter(self.model, self.head, draft) if (  # type: ignore[arg-type]
            draft and self.head is not None and not speculates) else None
        if tap is not None:
            self._tap = tap.plain
        if constraint is not None:
            rounds = self._constrained_rounds(prompt, target, sampler, budget, cancelled,
                                              constraint, sink)
        elif speculates:
            # the draft steps aside when logprobs are asked for
            speculator = Speculator(self.model, self._drafter(draft), target, options,
                                    self.depth_control)
            rounds = speculator.rounds(prompt, budget, cancelled)
        else:
            rounds = self._plain_rounds(prompt, target, sampler, budget, cancelled, sink)
        if self._shift_to is not None and speculator is None:
            rounds = self._shifting_rounds(prompt, target, sampler, options.num_keep,
                                           cancelled, sink)
        emission = self._emission = Emission(self.tokenizer, options,
                                             ReleasePolicy(self.release), sink)
        yield from emission.run(rounds)
        if speculator is not None:
            speculator.finish()
        if tap is not None:
            self._tap = None
            tap.finish(prompt + emission.read)
        # after a shift the match's caches still hold the prompt and the answer up to the
        # shift (later tokens went to fresh caches): close keeps what they computed
        self.prefix_cache.close(prompt + emission.read, match)
        ended = time.perf_counter_ns()
        first_at = emission.first_at or ended
        yield Done(emission.reason, len(prompt) - match.length, first_at - started,
                   emission.count, ended - first_at, match.length,
                   speculator.stats if speculator is not None else None)

    def _plain_rounds(self, prompt: list[int], cache: list[Cache], sampler: Sampler,
                      budget: int, cancelled: Callable[[], bool],
                      sink: LogprobSink | None = None) -> Iterator[list[int]]:
        """One token per round, pipelined: token n+1's graph is queued before n is read."""
        window = sampler.options.repeat_last_n
        window = window if window > 0 else len(prompt) + budget
        history = mx.array(prompt[-window:], dtype=mx.uint32) if sampler.uses_history else None

        def step(tokens: mx.array) -> mx.array:
            nonlocal history
            logits = self._target(tokens[None], cache)[0, -1]
            token = sampler(logits, history).astype(mx.uint32)
            if history is not None:
                history = mx.concatenate([history, token[None]])[-window:]
            if sink is not None:
                sink.queue(logits, token)
            return token

        count = 0
        # a cancelled prefill stopped short: feeding the last token now would put it at the
        # wrong position in a cache that the prefix cache keeps
        y = None
        if budget > 0 and not cancelled():
            y = step(mx.array(prompt[-1:], dtype=mx.uint32))
        if y is not None:
            mx.async_eval(y)
        while y is not None and not cancelled():
            count += 1
            following = step(y[None]) if count < budget else None
            if following is not None:
                mx.async_eval(following)
            token = token_id(y)
            if sink is not None:
                sink.read(token)
            yield [token]
            y = following

    def _shifting_rounds(self, prompt: list[int], cache: list[Cache], sampler: Sampler,
                         num_keep: int, cancelled: Callable[[], bool],
                         sink: LogprobSink | None) -> Iterator[list[int]]:
        """Plain rounds until the context is full, then shift it and go on: the kept tokens
        are evaluated again into fresh caches (so every position is where RoPE expects it)."""
        assert self._shift_to is not None
        left, num_ctx = self._shift_to
        sequence = list(prompt)
        while left > 0 and not cancelled():
            budget = min(left, num_ctx - len(sequence))
            for tokens in self._plain_rounds(sequence, cache, sampler, budget, cancelled, sink):
                sequence += tokens
                left -= len(tokens)
                yield tokens
            if left <= 0 or cancelled():
                return
            sequence = shifted(sequence, num_keep)
            self._tap = None  # the MTP head keeps the match's caches, which end here
            cache = new_caches(self.model)
            self.prefill(Match(0, cache, sequence), cancelled)  # fresh, outside the trie
            self.shifted = True

    def _constrained_rounds(self, prompt: list[int], cache: list[Cache], sampler: Sampler,
                            budget: int, cancelled: Callable[[], bool],
                            constraint: TokenConstraint,
                            sink: LogprobSink | None = None) -> Iterator[list[int]]:
        """One token per round, pipelined like `_plain_rounds`: the forward pass for token n+1
        is queued before token n is read back, and the grammar's mask for n+1 is computed on
        the CPU while that pass runs (it only needs token n)."""
        window = sampler.options.repeat_last_n
        window = window if window > 0 else len(prompt) + budget
        history = mx.array(prompt[-window:], dtype=mx.uint32) if sampler.uses_history else None

        def forward(token: mx.array) -> mx.array:
            logits = self._target(token.reshape(1, 1), cache)[0, -1]
            mx.async_eval(logits)
            return logits

        logits = forward(mx.array(prompt[-1:], dtype=mx.uint32)) if budget > 0 else None
        count = 0
        while logits is not None and not cancelled():
            allowed = constraint.allowed(logits.shape[-1])
            masked = mx.where(allowed, logits.astype(mx.float32), -float("inf"))
            y = sampler(masked, history).astype(mx.uint32)
            if history is not None:
                history = mx.concatenate([history, y[None]])[-window:]
            if sink is not None:
                sink.queue(logits, y)
            count += 1
            logits = forward(y) if count < budget else None
            token = token_id(y)
            constraint.accept(token)
            if sink is not None:
                sink.read(token)
            yield [token]


def shifted(tokens: list[int], num_keep: int) -> list[int]:
    """Ollama's context shift: keep the first `num_keep`, drop the older half of the rest."""
    keep = max(0, min(num_keep, len(tokens) - 1))
    discard = (len(tokens) - keep) // 2
    return tokens[:keep] + tokens[keep + discard:]


class Emission:
    """Tokens -> text pieces: EOS, stop strings, counts and the release rule, per round."""

    def __init__(self, tokenizer: ModelTokenizer, options: Options,
                 policy: ReleasePolicy, sink: LogprobSink | None = None) -> None:
        self.tokenizer = tokenizer
        self.sink = sink
        self.detok, self.stops = tokenizer.detokenizer(), StopFilter(options.stop)
        self.policy = policy
        self.reason, self.count, self.first_at = "length", 0, 0
        self.read: list[int] = []  # every token read back, EOS included (it is in the cache)

    def run(self, rounds: Iterator[list[int]]) -> Iterator[str | Logprob]:
        for tokens in rounds:
            self.first_at = self.first_at or time.perf_counter_ns()
            before = self.count
            yield from self._round(tokens)
            self.policy.generated(self.count - before)
            if self.reason != "length":
                break
        if self.reason != "stop_string":
            tail, stopped = self.stops.feed(self.detok.flush())
            tail += "" if stopped else self.stops.flush()
            if tail:
                yield tail
        if self.reason == "stop_string":
            self.reason = "stop"

    def _round(self, tokens: list[int]) -> Iterator[str | Logprob]:
        for token in tokens:
            self.read.append(token)
            logprob = self.sink.pop() if self.sink is not None else None
            if token in self.tokenizer.eos_ids:
                self.reason = "stop"
                return
            self.count += 1
            if logprob is not None:
                yield logprob
            text, stopped = self.stops.feed(self.detok.add(token))
            if text:
                yield text
            if stopped:
                self.reason = "stop_string"
                return
