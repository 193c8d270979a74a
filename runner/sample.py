"""Sampling options (Ollama's names) and the sampler that turns logits into the next token.

Everything runs as MLX ops on the logits, so the sampled token is part of the same lazy graph as
the forward pass and decode can be pipelined with `mx.async_eval`. Randomness comes from an
explicit key split once per token from the request's `seed`: the same seed gives the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any

import mlx.core as mx


class OptionsError(ValueError):
    """An option has the wrong type or range; the message names it."""


@dataclass(frozen=True)
class Options:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    num_predict: int = -1
    num_ctx: int | None = None
    num_keep: int = 4  # tokens kept at the start when the context shifts

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> Options:
        """Known keys only (unknown Ollama options are ignored, as Ollama's runner does)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            value = (raw or {}).get(f.name)
            if value is None:
                continue
            values[f.name] = _coerce(f.name, value)
        return cls(**values)


def _coerce(name: str, value: Any) -> Any:
    try:
        if name == "stop":
            items = [value] if isinstance(value, str) else list(value)
            return tuple(str(s) for s in items if str(s))
        if name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            return float(value)
        return int(value)
    except (TypeError, ValueError) as exc:
        raise OptionsError(f"option {name} has an invalid value {value!r}") from exc


class Sampler:
    """One request's sampler: repeat penalty over recent tokens, then greedy or top-k/top-p/
    min-p filtered sampling at `temperature`."""

    def __init__(self, options: Options) -> None:
        self.options = options
        seed = options.seed if options.seed is not None and options.seed >= 0 else None
        self._key = mx.random.key(seed if seed is not None else random.getrandbits(32))

    @property
    def uses_history(self) -> bool:
        return self.options.repeat_penalty != 1.0 and self.options.repeat_last_n != 0

    def __call__(self, logits: mx.array, history: mx.array | None = None) -> mx.array:
        """logits: [vocab]; history: recent token ids (uint32, lazy is fine), only read when
        the repeat penalty is on. Returns a scalar token id array (lazy)."""
        opts = self.options
        logits = logits.astype(mx.float32)
        if self.uses_history and history is not None and history.size:
            logits = apply_repeat_penalty(logits, history, opts.repeat_penalty)
        if opts.temperature <= 0:
            return mx.argmax(logits, axis=-1)
        logits = filter_logits(logits / opts.temperature, opts.top_k, opts.top_p, opts.min_p)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logits, key=key)


def apply_repeat_penalty(logits: mx.array, ids: mx.array, penalty: float) -> mx.array:
    """Divide positive, multiply negative logits of tokens seen recently (llama.cpp rule).
    A repeated id is written twice with the same value, so duplicates need no dedup. Ids past
    the vocabulary (a prompt's image keys) land in a scratch slot that is dropped."""
    vocab = logits.shape[-1]
    ids = mx.minimum(ids, vocab)
    padded = mx.concatenate([logits, mx.zeros((1,), logits.dtype)])
    picked = padded[ids]
    padded[ids] = mx.where(picked > 0, picked / penalty, picked * penalty)
    return padded[:vocab]


def filter_logits(logits: mx.array, top_k: int, top_p: float, min_p: float) -> mx.array:
    """-inf for tokens outside top_k, outside the top_p nucleus, or below min_p * p_max."""
    neg_inf = mx.array(-float("inf"), logits.dtype)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.sort(mx.partition(logits, vocab - top_k, axis=-1)[..., vocab - top_k:])[..., 0]
        logits = mx.where(logits < kth, neg_inf, logits)
    if 0.0 < top_p < 1.0:
        order = mx.argsort(-logits, axis=-1)
        sorted_probs = mx.softmax(logits[order], axis=-1)
        cumulative = mx.cumsum(sorted_probs, axis=-1)
        keep_sorted = (cumulative - sorted_probs) < top_p  # always keeps the most likely
        keep = mx.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        logits = mx.where(keep, logits, neg_inf)
    if min_p > 0.0:
        probs = mx.softmax(logits, axis=-1)
        logits = mx.where(probs < min_p * probs.max(), neg_inf, logits)
    return logits
