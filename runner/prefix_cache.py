"""Caches kept across requests in a compressed token trie (reference 3.4).

A chat's next turn re-sends the whole conversation, so each request starts where an earlier one
went. Every node holds an edge of tokens with the KV parts that cover that edge exactly (one per
rewindable layer, `KVCache`) and, optionally, a whole-state checkpoint of every layer that cannot
rewind (`RecurrentCache`, `SlidingWindowCache`), valid only at the node's end.

`begin` walks the longest match, backs off one token (the decode loop needs the last prompt
token's logits) and out of any non-causal span it would end inside, then resumes at the newest
checkpoint at or before that point (anywhere, for a model without whole-state layers: the node is
split there, the head stays on the path and is touched, the unused tail can be evicted). What lies
between the resume point and the match is prefilled again, and a checkpoint is captured at the
match (and at the prompt's end), so the next request resumes there. `close` inserts what the
request computed, splitting an edge where it diverges or ends (a response that is a prefix of a
stored one lands on the split-off head, which takes the checkpoints it lacks), then evicts.

Eviction keeps the bytes under the budget: least recently used first, then deepest, then largest;
the root, the frontier (where the last request ended) and branch points are never picked. A leaf
is dropped; a node with one child is merged into it (the child keeps its own, newer, checkpoint;
the KV parts are joined and the consumed arrays released), so a rewind to a merged-away turn
resumes at the newest surviving checkpoint before it. Nodes without a checkpoint that have one
child are merged on `close` as well: they record nothing a longer edge does not.

The active path (root to the node where the last request ended) is backed by that request's KV
caches, which `close` keeps as the live caches: its nodes hold no KV of their own, only their
range [start, end) of the live buffers ("views"), and the live buffers are accounted once, whole
(spare capacity included). Only when that is tight: if the buffers hold more than `view_slack`
times what the views cover (a short conversation in a buffer grown by 256 positions), the views
are copied at `close` and the buffers go with the request, which holds less. A view is not an
MLX slice: a slice alive would make the next write into the buffer copy all of it (MLX writes in
place only into an array nothing else shares), so a view is sliced only when it is materialised.
The next request that resumes on the active path continues in the live caches: the views past
its resume point are materialised first (copy on divergence: the request is about to overwrite
those positions), the rest stay views. A request that resumes elsewhere materialises every view
and the live buffers go. Eviction that would drop a view materialises the others first, so it
frees what a node holding copies would have freed.

Memory: what `nbytes` reports is what the trie holds. Every array a node keeps owns its buffer:
materialised views, split halves of owned nodes and checkpoints are copies, evaluated when taken
(a lazy copy keeps its source alive). Nodes refer to their parents, so a dropped subtree waits
for Python's cycle collector; evicted leaves and merged nodes are freed at once.

Spans: ranges of prompt positions that must be evaluated in one forward (a media item's tokens
attend to each other both ways). No prefill chunk ends inside one, a capture scheduled inside one
lands at its end, and a match ending inside one resumes at its start.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from runner.kv_cache import Cache, KVCache

DEFAULT_BUDGET_BYTES = 1 << 30  # the most cache bytes kept between requests
VIEW_SLACK = 1.25  # live buffers kept for views only while they hold at most this x the views
Span = tuple[int, int]  # [start, end) prompt positions evaluated in one forward
KVPart = tuple[mx.array, mx.array]


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    start: int
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)
    kv: list[KVPart] = field(default_factory=list)  # per rewindable layer, [start, end)
    viewed: bool = False  # the KV is the live caches' [start, end) instead (`kv` is empty)
    state: list[Any] | None = None  # per whole-state layer, valid at `end`
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def depth(self) -> int:
        return self.start

    def nbytes(self) -> int:
        arrays = [a for part in self.kv for a in part]
        arrays += [a for s in self.state or [] for a in s if isinstance(a, mx.array)]
        return sum(a.nbytes for a in arrays)


@dataclass
class Match:
    """Caches for one request holding `length` prompt tokens; `captures` are the offsets at
    which the prefill stops to checkpoint the whole-state layers."""

    length: int
    caches: list[Cache]
    prompt: list[int]
    spans: tuple[Span, ...] = ()
    captures: list[int] = field(default_factory=list)
    taken: dict[int, list[Any]] = field(default_factory=dict)

    def chunks(self, end: int, size: int) -> Iterator[tuple[int, int]]:
        """[start, stop) prefill chunks from `length` to `end`: at most `size` tokens unless a
        span needs more, stopping at each capture, never ending inside a span."""
        start = self.length
        stops = sorted({c for c in self.captures if start < c < end} | {end})
        while start < end:
            stop = min(start + size, stops[0])
            stop = _outside_spans(stop, self.spans, start)
            yield start, stop
            start = stop
            stops = [s for s in stops if s > start] or [end]

    def capture(self, offset: int) -> None:
        """Checkpoint the whole-state layers if a capture is due at `offset`."""
        if offset in self.captures:
            self.taken[offset] = snapshots(self.caches)


def snapshots(caches: Sequence[Cache]) -> list[Any]:
    """Whole-state snapshots of the layers that cannot rewind, in layer order."""
    return [c.snapshot() for c in caches if not c.rewindable]  # type: ignore[union-attr]


def _outside_spans(stop: int, spans: Sequence[Span], floor: int) -> int:
    """`stop` moved out of any span it falls strictly inside: back to the span's start when
    that is past `floor`, else on to its end."""
    for start, end in spans:
        if start < stop < end:
            return start if start > floor else end
    return stop


def span_start(offset: int, spans: Sequence[Span]) -> int:
    for start, end in spans:
        if start < offset < end:
            return start
    return offset


class PrefixCache:
    """The trie, its byte budget and the request protocol (`begin` ... `close`)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.root = Node((), 0, state=[])
        self.frontier: Node = self.root
        self._clock = itertools.count(1)
        self._bytes = 0  # running totals: /v1/status reads them from another thread
        self._count = 0
        self._live: list[KVCache] = []  # the rewindable caches the active path's views read
        self._live_bytes = 0
        self.view_slack = VIEW_SLACK
        self.events: Counter[str] = Counter()  # splits, merges, evictions: for tests and status

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._bytes

    def nodes(self) -> Iterator[Node]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def resize(self, budget_bytes: int) -> None:
        """A new budget, enforced at once."""
        self.budget_bytes = budget_bytes
        self._evict()

    def clear(self) -> None:
        self.root = self.frontier = Node((), 0, state=[])
        self._bytes = self._count = self._live_bytes = 0
        self._live = []

    # -- begin -------------------------------------------------------------------------------
    def begin(self, prompt: list[int], make_caches: Callable[[], list[Cache]],
              spans: Sequence[Span] = ()) -> Match:
        """Caches for `prompt` holding the longest reusable prefix; at least the prompt's last
        token is left to evaluate."""
        caches = make_caches()
        spans = tuple(sorted(spans))
        path, matched = self._walk(prompt)
        target = span_start(min(matched, len(prompt) - 1), spans)
        whole = [c for c in caches if not c.rewindable]
        if not whole and target > 0:
            path = self._split_path(path, target)
        resume = self._resume_point(path, target, bool(whole))
        used = [n for n in path if n.end <= resume]
        if resume > 0 and all(n.viewed for n in used) and self._adopt(caches):
            self._continue(caches, used, resume)
        else:
            self._release_live()
            self._load(caches, used)
        captures = sorted({c for c in (target, len(prompt) - 1) if c > resume})
        captures = sorted({_span_end(c, spans) for c in captures})
        return Match(resume, caches, list(prompt), spans, captures if whole else [])

    def _walk(self, tokens: Sequence[int]) -> tuple[list[Node], int]:
        """Nodes along the longest match (the last possibly matched only in part) and its
        length."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            shared = _common(child.tokens, tokens[pos:])
            path.append(child)
            pos += shared
            if shared < len(child.tokens):
                break
            node = child
        return path, pos

    def _split_path(self, path: list[Node], offset: int) -> list[Node]:
        """Cut the path at `offset`, splitting the node it falls inside (KV-only models)."""
        kept = [n for n in path if n.start < offset]
        if kept and kept[-1].end > offset:
            kept[-1] = self._split(kept[-1], offset)
        return kept

    def _resume_point(self, path: list[Node], target: int, whole: bool) -> int:
        """The furthest offset <= target the caches can be put at, touching what it uses."""
        resume = 0
        for node in path:
            if node.end > target:
                break
            if not whole or node.state is not None:
                resume = node.end
        if not whole:
            resume = min(target, path[-1].end) if path else 0
        tick = next(self._clock)
        for node in path:
            if node.start < resume:
                node.last_used = tick
        return resume

    def _adopt(self, caches: list[Cache]) -> bool:
        """Put the live caches in place of the fresh rewindable ones, if they are of one
        kind each."""
        fresh = [i for i, c in enumerate(caches) if c.rewindable]
        if not self._live or len(fresh) != len(self._live) or any(
                type(caches[i]) is not type(live)
                for i, live in zip(fresh, self._live, strict=True)):
            return False
        for i, live in zip(fresh, self._live, strict=True):
            caches[i] = live
        return True

    def _continue(self, caches: list[Cache], used: list[Node], resume: int) -> None:
        """Go on in the live caches from `resume`: what the request will overwrite is copied
        out first, the whole-state layers are restored from the checkpoint there."""
        for node in self._viewed():
            if node.end > resume:
                self._materialise(node)
        for live in self._live:
            live.rewind(resume)
        whole = [c for c in caches if not c.rewindable]
        for i, cache in enumerate(whole):
            cache.restore(used[-1].state[i])  # type: ignore[index,union-attr]
        mx.eval([c.state for c in caches])

    def _load(self, caches: list[Cache], used: list[Node]) -> None:
        if not used:
            return
        kv = [c for c in caches if c.rewindable]
        for i, cache in enumerate(kv):
            cache.load([n.kv[i] for n in used])  # type: ignore[union-attr]
        whole = [c for c in caches if not c.rewindable]
        for i, cache in enumerate(whole):
            cache.restore(used[-1].state[i])  # type: ignore[index,union-attr]
        mx.eval([c.state for c in caches])

    # -- close -------------------------------------------------------------------------------
    def close(self, tokens: list[int], match: Match) -> None:
        """Keep what `match.caches` computed for `tokens` (prompt and answer); the caller hands
        the caches over and must not write to them again."""
        caches = match.caches
        length = min(len(tokens), min((c.offset for c in caches), default=0))
        if length <= 0:
            return
        for cache in caches:
            if cache.rewindable:
                cache.rewind(length)  # type: ignore[union-attr]
            elif cache.offset != length:
                return  # a whole-state layer ran ahead of the others: nothing is consistent
        mx.eval([c.state for c in caches])
        live = [c for c in caches if c.rewindable]
        if len(live) != len(self._live) or any(
                a is not b for a, b in zip(live, self._live, strict=True)):
            self._release_live()
        self._live = live  # type: ignore[assignment]
        leaf = self._insert(tokens[:length], caches)
        checkpoints = dict(match.taken)
        checkpoints[length] = snapshots(caches)
        for offset, state in sorted(checkpoints.items()):
            if 0 < offset <= length:
                self._checkpoint(tokens[:offset], state)
        self.frontier = self._node_ending(tokens[:length]) or leaf
        self._view_path(self.frontier)
        if self._live_bytes > self.view_slack * self._viewed_bytes():
            self._release_live()  # copies hold less than the buffers' spare capacity would
        self._touch(self.frontier)
        self._compact(self.frontier)
        self._evict()

    def _insert(self, tokens: list[int], caches: list[Cache]) -> Node:
        """The nodes for `tokens`, splitting where they diverge or end; a new leaf is a view
        of the live caches, which hold `tokens`."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(tuple(tokens[pos:]), pos, node, viewed=True)
                self._add(node, leaf)
                return leaf
            shared = _common(child.tokens, tokens[pos:])
            if shared < len(child.tokens):
                child = self._split(child, pos + shared)
            node, pos = child, pos + shared
        return node

    def _checkpoint(self, tokens: list[int], state: list[Any]) -> None:
        """Attach `state` (valid after `tokens`) to the node ending there, splitting an edge."""
        path, matched = self._walk(tokens)
        if matched < len(tokens) or not path:
            return
        node = path[-1]
        if node.end > len(tokens):
            node = self._split(node, len(tokens))
        if node.state is None:
            node.state = state
            self._bytes += _state_bytes(state)

    def _node_ending(self, tokens: list[int]) -> Node | None:
        path, matched = self._walk(tokens)
        if path and matched == len(tokens) and path[-1].end == len(tokens):
            return path[-1]
        return None

    # -- views of the live caches -------------------------------------------------------------
    def _viewed(self) -> list[Node]:
        return [n for n in self.nodes() if n.viewed]

    def _parts(self, node: Node) -> list[KVPart]:
        """The node's KV, sliced out of the live caches for a view (for a copy, or a load)."""
        if not node.viewed:
            return node.kv
        return [c.part(node.start, node.end) for c in self._live]

    def _viewed_bytes(self) -> int:
        """What the views would hold as copies (the live buffers hold spare capacity too)."""
        return sum(a.nbytes for n in self._viewed() for part in self._parts(n) for a in part)

    def _materialise(self, node: Node) -> None:
        """A view becomes a copy the node owns."""
        node.kv = [_copy(p) for p in self._parts(node)]
        node.viewed = False
        self._bytes += node.nbytes() - _state_bytes(node.state or [])

    def _view_path(self, node: Node) -> None:
        """Every node from the root to `node` becomes a view of the live caches (which hold
        those positions: the request that just closed computed or loaded them), its copy freed;
        the live buffers are accounted once, as they are now."""
        current: Node | None = node
        while current is not None and current is not self.root:
            if not current.viewed:
                self._bytes -= current.nbytes() - _state_bytes(current.state or [])
                current.kv, current.viewed = [], True
            current = current.parent
        held = sum(c.nbytes() for c in self._live)
        self._bytes += held - self._live_bytes
        self._live_bytes = held

    def _release_live(self, dropping: Node | None = None) -> None:
        """Materialise every view (but `dropping`'s, about to go) and let the live caches go."""
        for node in self._viewed():
            if node is dropping:
                node.viewed = False
            else:
                self._materialise(node)
        self._bytes -= self._live_bytes
        self._live, self._live_bytes = [], 0

    # -- structure ---------------------------------------------------------------------------
    def _add(self, parent: Node, child: Node) -> None:
        child.parent = parent
        parent.children[child.tokens[0]] = child
        self._bytes += child.nbytes()
        self._count += 1

    def _split(self, node: Node, offset: int) -> Node:
        """Split `node` at absolute `offset`; returns the head (the tail keeps the children and
        the checkpoint, which is valid at its end)."""
        cut = offset - node.start
        self.events["split"] += 1
        assert 0 < cut < len(node.tokens) and node.parent is not None
        head = Node(node.tokens[:cut], node.start, node.parent, last_used=node.last_used,
                    viewed=node.viewed)
        if not node.viewed:  # views are split by their ranges alone
            parts, node.kv = node.kv, []
            head.kv = [_copy((k[..., :cut, :], v[..., :cut, :])) for k, v in parts]
            node.kv = [_copy((k[..., cut:, :], v[..., cut:, :])) for k, v in parts]
            del parts  # the unsplit arrays go now; either half may be evicted alone later
        node.parent.children[head.tokens[0]] = head
        node.tokens, node.start, node.parent = node.tokens[cut:], offset, head
        head.children[node.tokens[0]] = node
        self._count += 1
        return head

    def _merge_into_child(self, node: Node) -> None:
        """Join a one-child node with its child, which keeps its own (newer) checkpoint."""
        (child,) = node.children.values()
        self.events["merge"] += 1
        parent = node.parent
        assert parent is not None
        if node.viewed != child.viewed:  # off the active path, or at its end: copies
            self._materialise(node if node.viewed else child)
        self._bytes -= node.nbytes() + child.nbytes()
        if not child.viewed:  # two views join as ranges
            kv = [(mx.concatenate([a[0], b[0]], axis=2), mx.concatenate([a[1], b[1]], axis=2))
                  for a, b in zip(node.kv, child.kv, strict=True)]
            node.kv, child.kv = [], []
            mx.eval(kv)
            child.kv = kv
        child.tokens, child.start, child.parent = node.tokens + child.tokens, node.start, parent
        child.last_used = max(child.last_used, node.last_used)
        parent.children[child.tokens[0]] = child
        self._bytes += child.nbytes()
        self._count -= 1

    def _remove_leaf(self, node: Node) -> None:
        assert node.parent is not None and not node.children
        if node.viewed:  # the live buffers go with it, what the other views cover is copied
            self._release_live(dropping=node)
        del node.parent.children[node.tokens[0]]
        self._bytes -= node.nbytes()
        self._count -= 1

    def _touch(self, node: Node) -> None:
        tick = next(self._clock)
        current: Node | None = node
        while current is not None and current is not self.root:
            current.last_used = tick
            current = current.parent

    def _compact(self, node: Node) -> None:
        """Merge the checkpoint-less one-child nodes along the path to `node` into their child.
        For a model without whole-state layers every node qualifies (its KV can be cut
        anywhere); for a hybrid one, only nodes that never got a checkpoint."""
        current = node.parent
        while current is not None and current is not self.root:
            parent = current.parent
            if len(current.children) == 1 and not current.state:
                self._merge_into_child(current)
            current = parent

    def _evict(self) -> None:
        while self._bytes > self.budget_bytes:
            victim = self._victim()
            if victim is None and self.frontier is not self.root and not self.frontier.children:
                victim, self.frontier = self.frontier, self.root  # alone over the budget
            if victim is None:
                return
            self.events["evict"] += 1
            if victim.children:
                self._merge_into_child(victim)
            else:
                self._remove_leaf(victim)

    def _victim(self) -> Node | None:
        candidates = [n for n in self.nodes()
                      if n is not self.frontier and len(n.children) <= 1]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (n.last_used, -n.depth, -n.nbytes()))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _span_end(offset: int, spans: Sequence[Span]) -> int:
    for start, end in spans:
        if start < offset < end:
            return end
    return offset


def _copy(part: KVPart) -> KVPart:
    """KV positions copied out of a larger buffer (the live cache, a node being split), and
    evaluated now: a view, or a lazy copy, would keep the whole buffer alive."""
    copy = mx.contiguous(part[0]), mx.contiguous(part[1])
    mx.eval(copy)
    return copy


def _state_bytes(state: list[Any]) -> int:
    return sum(a.nbytes for s in state for a in s if isinstance(a, mx.array))
