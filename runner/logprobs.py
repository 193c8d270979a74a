"""Log-probabilities of sampled tokens, as Ollama reports them (`logprobs`, `top_logprobs`).

Computed from the model's raw logits (before penalties, temperature and filtering), as lazy MLX
ops in the same graph as the sampled token, and read back with it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from runner.readback import number, numbers, token_ids

MAX_TOP = 20


@dataclass(frozen=True)
class Logprob:
    """One emitted token's log-probability, and the `top` most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"token": self.token, "logprob": self.logprob,
                               "bytes": list(self.token.encode())}
        if self.top:
            out["top_logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                   for t, lp in self.top]
        return out


def logprob_graph(logits: mx.array, token: mx.array, top: int) -> tuple[mx.array, ...]:
    """(the token's logprob, the top ids, their logprobs): lazy, for `read_logprob`."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top <= 0:
        return (logprobs[token],)
    ids = mx.argpartition(-logprobs, top - 1)[:top]
    order = mx.argsort(-logprobs[ids])
    return logprobs[token], ids[order], logprobs[ids[order]]


def read_logprob(graph: tuple[mx.array, ...], decode: Any, token: int) -> Logprob:
    """The evaluated graph as a Logprob; `decode` turns one token id into its text."""
    top = []
    if len(graph) == 3:
        top = [(decode([i]), v) for i, v in zip(token_ids(graph[1]), numbers(graph[2]),
                                                 strict=True)]
    return Logprob(decode([token]), number(graph[0]), top)


class LogprobSink:
    """Per request: the graphs queued with each sampled token, read back in order."""

    def __init__(self, top: int, decode: Callable[[list[int]], str]) -> None:
        self.top = max(0, min(top, MAX_TOP))
        self.decode = decode
        self._graphs: deque[tuple[mx.array, ...]] = deque()
        self._ready: deque[Logprob] = deque()

    def queue(self, logits: mx.array, token: mx.array) -> None:
        graph = logprob_graph(logits, token, self.top)
        mx.async_eval(*graph)
        self._graphs.append(graph)

    def read(self, token: int) -> None:
        self._ready.append(read_logprob(self._graphs.popleft(), self.decode, token))

    def pop(self) -> Logprob | None:
        return self._ready.popleft() if self._ready else None
