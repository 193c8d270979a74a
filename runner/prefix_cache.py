"""KV caches kept across requests, found by the longest shared token prefix (reference 3.4).

A chat's next turn re-sends the whole conversation: its prompt is the previous prompt, the
answer and a new message. Each finished request leaves its caches here (target and, with a
draft, the draft's) keyed by the tokens they hold; the next request copies the longest matching
prefix out instead of prefilling it again. This is the "last K sequences" form of Ollama's trie:
an entry whose tokens are a prefix of a newer one is dropped as redundant, so one conversation
keeps one entry, and sequences that diverge keep one each until the byte budget evicts the least
recently used.

A full match is backed off by one token: the decode loop needs the logits of the prompt's last
token, so at least one token is always evaluated.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from runner.kv_cache import KVCache

DEFAULT_BUDGET_BYTES = 1 << 30  # the most cache bytes kept between requests


@dataclass
class Entry:
    tokens: tuple[int, ...]
    target: list[KVCache]
    draft: list[KVCache] | None
    nbytes: int = 0  # fixed once recorded: an entry's caches are never written again


@dataclass
class Match:
    """Caches ready for a request: `length` prompt tokens already in the target cache."""

    length: int
    target: list[KVCache]
    draft: list[KVCache] | None


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Token sequences with the caches that computed them; LRU under `budget_bytes`."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._next_id = 0
        self._bytes = 0  # kept as a running total: /v1/status reads it from another thread

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def lookup(self, prompt: list[int], num_layers: int,
               draft_layers: int | None) -> Match:
        """Fresh caches for `prompt`, prefilled with the longest cached prefix (copied, so the
        entry stays valid whatever this request does to them)."""
        best_id, best = None, 0
        for key, entry in self._entries.items():
            shared = common_prefix(entry.tokens, prompt)
            if shared > best:
                best_id, best = key, shared
        best = min(best, len(prompt) - 1)  # always evaluate at least the last token
        if best_id is None or best <= 0:
            return Match(0, _fresh(num_layers), _empty(draft_layers))
        self._entries.move_to_end(best_id)
        entry = self._entries[best_id]
        target = [c.prefix_copy(best) for c in entry.target]
        draft = _empty(draft_layers)
        if draft_layers is not None and entry.draft is not None:
            draft = [c.prefix_copy(best) for c in entry.draft]
        return Match(best, target, draft)

    def record(self, tokens: list[int], target: list[KVCache],
               draft: list[KVCache] | None) -> None:
        """Keep `target` (and `draft`), which hold the first `offset` of `tokens`; the caller
        hands them over and must not write to them again."""
        length = min(len(tokens), target[0].offset if target else 0)
        if length <= 0:
            return
        key = tuple(tokens[:length])
        for cache in target + (draft or []):
            cache.rewind(length)
        for old_id in [k for k, e in self._entries.items() if e.tokens == key[:len(e.tokens)]]:
            self._bytes -= self._entries.pop(old_id).nbytes  # a prefix of the new entry
        nbytes = sum(c.nbytes() for c in target + (draft or []))
        self._entries[self._next_id] = Entry(key, target, draft, nbytes)
        self._next_id += 1
        self._bytes += nbytes
        self._evict()

    def _evict(self) -> None:
        while self._entries and self._bytes > self.budget_bytes:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def _fresh(num_layers: int) -> list[KVCache]:
    return [KVCache() for _ in range(num_layers)]


def _empty(num_layers: int | None) -> list[KVCache] | None:
    return None if num_layers is None else _fresh(num_layers)
