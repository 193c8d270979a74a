"""The inline MTP head as a speculative drafter (runner/speculative.py's `Drafter`).

Offsets (as mlx-vlm 0.7.10's autoregressive MTP drafters pair them): the head's cache position
t holds token t+1 paired with the target's final hidden state (after norm_f) at t, and its
output there predicts token t+2. So after the target has run positions ..t and token t+1 is
committed, the head can say t+2 before the target has seen t+1: that is the round's first
proposal. Further proposals feed the head's own output back as the hidden state.

Between rounds the head's cache plus the hidden states `pending` (target positions it has not
consumed yet) cover exactly the target's cache: a verify pass over [current]+drafts keeps
`accepted + 1` target positions, whose hidden states become pending; the head's own drafting
positions are rewound away and recomputed from the target's hidden states at the next proposal,
in one batched call, before drafting again (mlx-vlm keeps the drafted positions it accepted,
computed from its own hiddens; recomputing costs one small batched pass and keeps the cache
exactly what prefill would have built). Prefill feeds the head chunk by chunk beside the target
(`feed`), so the prefix cache stores the head's KV cache at the target's offsets.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.kv_cache import KVCache
from runner.speculative import Pick


def _language_model(target: nn.Module) -> Any:
    return getattr(target, "language_model", target)


def feed(target: nn.Module, head: nn.Module, tokens: list[int], hidden: mx.array,
         caches: list[KVCache]) -> mx.array:
    """Run the head over target positions t.. (`hidden`, [1, L, dims]) paired with tokens
    t+1.. (`tokens`, L of them); returns its normed outputs (lazy)."""
    embedded = target.draft_embed(mx.array(tokens, dtype=mx.uint32)[None])
    return head(embedded, hidden.astype(embedded.dtype), caches)


class MTPDrafter:
    needs_hidden = True

    def __init__(self, target: nn.Module, head: nn.Module, caches: list[KVCache]) -> None:
        self.target, self.head, self.caches = target, head, caches
        self.logits = _language_model(target)._logits  # the target's own lm_head
        self.pending: list[mx.array] = []  # target hiddens [1, L, dims] after the head's cache

    @property
    def offset(self) -> int:
        return self.caches[0].offset if self.caches else 0

    def _catch_up(self, context: list[int]) -> mx.array | None:
        """Feed the pending positions; the head's output at the last (None: nothing pending,
        so nothing to draft from yet, e.g. right after prefill)."""
        if not self.pending:
            return None
        hidden = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, 1)
        start = self.offset
        tokens = context[start + 1:start + 1 + hidden.shape[1]]
        self.pending = []
        if not tokens:
            return None
        # a request that ended at EOS may have run the target one position past its tokens
        out = feed(self.target, self.head, tokens, hidden[:, :len(tokens)], self.caches)
        return out[:, -1:]

    def propose(self, context: list[int], depth: int, pick: Pick
                ) -> tuple[list[mx.array], list[mx.array]]:
        out = self._catch_up(context)
        if out is None:
            return [], []
        tokens, dists = [], []
        for i in range(depth):
            token, dist = pick(self.logits(out)[0, -1])
            tokens.append(token)
            dists.append(dist)
            if i + 1 < depth:
                embedded = self.target.draft_embed(token.reshape(1, 1))
                out = self.head(embedded, out, self.caches)
        return tokens, dists

    def commit(self, before: int, proposed: int, accepted: int,
               hidden: mx.array | None) -> None:
        assert hidden is not None
        for cache in self.caches:
            cache.rewind(before)  # the drafting positions: recomputed from the target's hiddens
        self.pending = [hidden[:, :accepted + 1]]

    def plain(self, hidden: mx.array | None) -> None:
        assert hidden is not None
        self.pending.append(hidden)

    def finish(self, context: list[int]) -> None:
        """Feed what is pending (lazily): the head's cache then ends where the target's does,
        which is what the prefix cache can keep."""
        self._catch_up(context)
