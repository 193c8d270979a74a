"""Speculative decoding with a draft model or an inline MTP head (reference 3.5).

Each round the drafter proposes up to `depth` tokens one at a time; the target scores the last
committed token plus every proposal in one forward pass, so a round costs one target pass
however many of the proposals it keeps. Greedy: a proposal is kept while it equals the target's
argmax, and the target's own token follows (the correction, or a bonus when all were kept), so
the output is the target's greedy output. Sampling: standard rejection sampling (keep d with
probability min(1, p(d)/q(d)), else draw from max(p - q, 0) normalised), so the text follows the
target's distribution (after the same temperature/top-k/top-p/min-p filtering). A draft whose
proposals are mostly rejected only costs time, so `DepthControl` parks it (plain target rounds)
and probes it again now and then.

Cache invariant between rounds: the target cache holds every committed token but the last (the
one the next forward feeds); the drafter's caches hold a prefix of that, and catch up on what
they lack at the start of its next proposal. After the verify pass both are rewound to what was
committed: a KV cache moves its offset, a recurrent (Mamba) layer picks the state it recorded
at that position during the verify pass (`keep_steps`, runner/kv_cache.py). The whole round is
one lazy graph, read back once (twice when sampling).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import KVCache, RecurrentCache
from runner.readback import flags, token_id, token_ids
from runner.sample import Options, filter_logits

DRAFT_DEPTH = 4  # proposals per round
PARK_BELOW = 0.3  # acceptance (EWMA) under which drafting stops paying for itself
ACCEPT_ALPHA = 0.2  # EWMA weight of the latest round's acceptance
PARK_ROUNDS = 8  # plain rounds before the first probe; doubles while probes fail
MAX_PARK_ROUNDS = 256

Pick = Callable[[mx.array], tuple[mx.array, mx.array]]  # logits -> (token, its distribution)


@dataclass
class DraftStats:
    proposed: int = 0
    accepted: int = 0


class DepthControl:
    """How many tokens to draft next round: `depth`, or 0 ("parked": plain decode) while the
    acceptance rate is too low for drafting to pay, with a probe round after a parked stretch
    that doubles each time the draft still disappoints. Counts only, never clocks, so the same
    request decodes the same way on any machine. One per loaded model: it learns across
    requests."""

    def __init__(self, depth: int = DRAFT_DEPTH) -> None:
        self.depth = depth
        self.rate = 1.0
        self.parked = 0
        self.park_for = PARK_ROUNDS

    def take_parked(self, limit: int) -> int:
        """How many plain rounds to run now (at most `limit`); 0 when drafting is on."""
        taken = min(self.parked, limit)
        self.parked -= taken
        return taken

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.rate += ACCEPT_ALPHA * (accepted / proposed - self.rate)
        if self.rate >= PARK_BELOW:
            self.park_for = PARK_ROUNDS
            return
        self.parked = self.park_for
        self.park_for = min(2 * self.park_for, MAX_PARK_ROUNDS)


class Drafter(Protocol):
    """Where proposals come from: a separate draft model (`ModelDrafter`) or a head fed by the
    target's hidden states (runner/mtp_draft.py). `caches` travel with the target's in the
    prefix cache."""

    caches: list[Any]
    needs_hidden: bool  # whether the target's forward passes must hand over hidden states

    def propose(self, context: list[int], depth: int, pick: Pick
                ) -> tuple[list[mx.array], list[mx.array]]:
        """Up to `depth` lazy proposals following `context` and their distributions (none
        when it cannot propose yet)."""
        ...

    def commit(self, before: int, proposed: int, accepted: int,
               hidden: mx.array | None) -> None:
        """A verify pass over positions before.. kept `accepted` proposals and one target
        token; `hidden`: its hidden states (for `needs_hidden`)."""
        ...

    def plain(self, hidden: mx.array | None) -> None:
        """A target-only token was fed (parked rounds); `hidden`: its hidden state."""
        ...

    def finish(self, context: list[int]) -> None:
        """The request is over: bring the caches level with the target's if that is cheap."""
        ...


class ModelDrafter:
    """A separate draft model with its own caches, fed the committed tokens it lacks."""

    needs_hidden = False

    def __init__(self, model: nn.Module, caches: list[KVCache]) -> None:
        self.model, self.caches = model, caches

    def propose(self, context: list[int], depth: int, pick: Pick
                ) -> tuple[list[mx.array], list[mx.array]]:
        feed = mx.array(context[self.caches[0].offset:], dtype=mx.uint32)
        logits = self.model(feed[None], self.caches)[0, -1]
        tokens, dists = [], []
        for i in range(depth):
            token, dist = pick(logits)
            tokens.append(token)
            dists.append(dist)
            if i + 1 < depth:
                logits = self.model(token.reshape(1, 1), self.caches)[0, -1]
        return tokens, dists

    def commit(self, before: int, proposed: int, accepted: int,
               hidden: mx.array | None) -> None:
        for cache in self.caches:
            cache.rewind(before + 1 + min(accepted, proposed - 1))

    def plain(self, hidden: mx.array | None) -> None:
        """Nothing: the draft cache lags and catches up at the next proposal."""

    def finish(self, context: list[int]) -> None:
        """Feed what the draft lacks (lazily): the prefix cache keeps the offset all layers
        share, and a recurrent target layer's state is only valid at its own."""
        missing = context[self.caches[0].offset:len(context) - 1]
        if missing:
            self.model(mx.array(missing, dtype=mx.uint32)[None], self.caches)


class Speculator:
    """One request's speculative decode; `rounds` yields the tokens each round commits."""

    def __init__(self, target: nn.Module, drafter: Drafter | None, target_cache: list[Any],
                 options: Options, control: DepthControl | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.target_cache = target_cache
        self.options = options
        self.greedy = options.temperature <= 0
        self.control = control if control is not None else DepthControl()
        seed = options.seed if options.seed is not None and options.seed >= 0 else None
        self._key = mx.random.key(seed if seed is not None else random.getrandbits(32))
        self.stats = DraftStats()
        self.context: list[int] = []

    def rounds(self, context: list[int], budget: int,
               cancelled: Callable[[], bool]) -> Iterator[list[int]]:
        """`context`: every token so far, the last not yet fed to the target. Yields lists of
        committed tokens, `budget` in all at most."""
        self.context = context = list(context)
        emitted = 0
        while emitted < budget and not cancelled():
            parked = self.control.take_parked(budget - emitted)
            if parked:
                rounds = self._plain(context, parked, cancelled)
            else:
                rounds = iter([self._round(context, min(self.control.depth, budget - emitted - 1))])
            for new in rounds:
                context += new
                emitted += len(new)
                yield new

    def finish(self) -> None:
        """Bring the drafter level with the target (the prefix cache keeps the common part)."""
        if self.drafter is not None and self.context:
            self.drafter.finish(self.context)

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        """The target's logits for `inputs` (1-D) and, when the drafter wants them, its final
        hidden states."""
        if self.drafter is not None and self.drafter.needs_hidden:
            logits, hidden = self.target.forward_hidden(inputs[None], self.target_cache)
            return logits[0], hidden
        return self.target(inputs[None], self.target_cache)[0], None

    def _plain(self, context: list[int], count: int,
               cancelled: Callable[[], bool]) -> Iterator[list[int]]:
        """`count` target-only tokens, pipelined as in plain decode (the drafter is told of
        each, and catches up at the next proposal)."""
        def step(token: mx.array) -> mx.array:
            logits, hidden = self._forward(token.reshape(1))
            if self.drafter is not None:
                self.drafter.plain(hidden)
            return self._pick(logits[-1])[0]

        y: mx.array | None = step(mx.array(context[-1], dtype=mx.uint32))
        for i in range(count):
            assert y is not None
            following = step(y) if i + 1 < count else None
            mx.async_eval(y if following is None else following)
            yield [token_id(y)]
            if cancelled():
                return
            y = following

    def _round(self, context: list[int], depth: int) -> list[int]:
        before = len(context) - 1
        tokens, dists = ([], []) if depth <= 0 or self.drafter is None else (
            self.drafter.propose(context, depth, self._pick))
        depth = len(tokens)
        drafts = mx.stack(tokens) if tokens else None
        q = mx.stack(dists) if dists and not self.greedy else None
        last = mx.array(context[-1:], dtype=mx.uint32)
        inputs = last if drafts is None else mx.concatenate([last, drafts])
        recurrent = [c for c in self.target_cache if isinstance(c, RecurrentCache)]
        for cache in recurrent:
            cache.keep_steps = True  # it records each position's state, to rewind by a pick
        try:
            logits, hidden = self._forward(inputs)
        finally:
            for cache in recurrent:
                cache.keep_steps = False
        logits = logits.astype(mx.float32)
        if self.greedy:
            proposed, accepted, following = self._accept_greedy(drafts, logits)
        else:
            proposed, accepted, following = self._accept_sampled(drafts, q, logits)
        for cache in self.target_cache:
            cache.rewind(before + 1 + accepted)
        if self.drafter is not None:
            self.drafter.commit(before, depth, accepted, hidden)
        self.stats.proposed += depth
        self.stats.accepted += accepted
        self.control.observe(depth, accepted)
        return [*proposed[:accepted], following]

    def _pick(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        logits = logits.astype(mx.float32)
        if self.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.uint32), logits
        filtered = self._filtered(logits)
        token = mx.random.categorical(filtered, key=self._next_key()).astype(mx.uint32)
        return token, mx.softmax(filtered, axis=-1)

    def _filtered(self, logits: mx.array) -> mx.array:
        opts = self.options
        return filter_logits(logits / opts.temperature, opts.top_k, opts.top_p, opts.min_p)

    def _next_key(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key

    def _accept_greedy(self, drafts: mx.array | None,
                       logits: mx.array) -> tuple[list[int], int, int]:
        choices = mx.argmax(logits, axis=-1)
        mx.eval(choices, *([] if drafts is None else [drafts]))
        wanted = token_ids(choices)
        proposed = [] if drafts is None else token_ids(drafts)
        accepted = 0
        while accepted < len(proposed) and proposed[accepted] == wanted[accepted]:
            accepted += 1
        return proposed, accepted, wanted[accepted]

    def _accept_sampled(self, drafts: mx.array | None, q: mx.array | None,
                        logits: mx.array) -> tuple[list[int], int, int]:
        """Rejection sampling: keep d_i while u_i < p_i(d_i) / q_i(d_i); then draw the
        correction from max(p - q, 0), or the bonus from p after the last proposal."""
        p = mx.stack([mx.softmax(self._filtered(row), axis=-1) for row in logits])
        if drafts is None or q is None:
            return [], 0, self._draw(p[0])
        rows = mx.arange(drafts.shape[0])
        ratio = p[rows, drafts] / q[rows, drafts]
        keep = mx.random.uniform(shape=ratio.shape, key=self._next_key()) < ratio
        mx.eval(drafts, keep)
        proposed, kept = token_ids(drafts), flags(keep)
        accepted = kept.index(False) if False in kept else len(kept)
        if accepted == len(proposed):
            return proposed, accepted, self._draw(p[accepted])
        residual = mx.maximum(p[accepted] - q[accepted], 0.0)
        dist = mx.where(residual.sum() > 0, residual, p[accepted])
        return proposed, accepted, self._draw(dist)

    def _draw(self, dist: mx.array) -> int:
        """One token from an (unnormalised) distribution; zero-probability tokens never."""
        return token_id(mx.random.categorical(mx.log(dist), key=self._next_key()))
