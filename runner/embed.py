"""Text embeddings: tokenize a batch, one padded forward, pool, normalise.

Pooling follows the checkpoint's sentence-transformers files when it has them: `modules.json`
names the Pooling module's folder (usually `1_Pooling`), whose `config.json` sets the mode
(`pooling_mode_mean_tokens`, `_cls_token`, `_lasttoken`); without them, the architecture's
`DEFAULT_POOLING`. Vectors are always L2-normalised, as Ollama returns them (which makes a
sentence-transformers `Normalize` module a no-op here); `dimensions` keeps the first n
components (Matryoshka truncation) and normalises again.

A batch is sorted by length and cut into forwards of at most MAX_FORWARD_TOKENS padded tokens
(one forward for any ordinary request); each is right-padded to its longest text with a 0/1
mask: encoders keep padding out of attention with the mask; decoders are causal, so padding
after a row's last token is never seen by it. Either way a text's vector does not depend on
what it was batched with.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runner.models import is_embedding_architecture, model_module
from runner.tokenizer import ModelTokenizer

POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_lasttoken": "last"}
POOLING_MODULE = "sentence_transformers.models.Pooling"
# Padded tokens per forward: a request's texts share forwards up to this size, which bounds the
# activations (and the attention scores, rows x heads x length^2) of a huge batch.
MAX_FORWARD_TOKENS = 8192


class EmbedError(ValueError):
    """A request the model cannot embed (too long without truncation, bad dimensions)."""


@dataclass
class Embeddings:
    vectors: list[list[float]]
    prompt_eval_count: int
    prompt_eval_duration: int  # ns


def pooling_mode(files: dict[str, bytes], default: str) -> str:
    """The pooling the checkpoint's sentence-transformers config asks for, else `default`."""
    folder = "1_Pooling"
    if "modules.json" in files:
        modules = json.loads(files["modules.json"])
        pools = [str(m["path"]) for m in modules if isinstance(m, dict)
                 and m.get("type") == POOLING_MODULE and isinstance(m.get("path"), str)]
        folder = pools[0] if pools else folder
    config = json.loads(files.get(f"{folder}/config.json", b"{}"))
    for key, mode in POOLING_MODES.items():
        if config.get(key):
            return mode
    return default


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """[batch, hidden] from [batch, length, hidden] under the 0/1 `mask` (right padding)."""
    if mode == "cls":
        return hidden[:, 0, :]
    if mode == "last":
        last = mask.sum(axis=1).astype(mx.int32) - 1
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0, :]
    weights = mask.astype(hidden.dtype)[:, :, None]
    return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)


def normalise(vectors: mx.array, dimensions: int | None) -> mx.array:
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    norms = mx.sqrt((vectors * vectors).sum(axis=1, keepdims=True))
    return vectors / mx.maximum(norms, 1e-12)


class Embedder:
    """Embeds texts with one loaded model; not thread-safe (the runner's worker owns it)."""

    def __init__(self, model: nn.Module, tokenizer: ModelTokenizer, mode: str,
                 max_tokens: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.mode = mode
        self.max_tokens = max_tokens
        self.pad_id = _pad_id(tokenizer)
        self.forward_tokens = MAX_FORWARD_TOKENS

    def tokens(self, text: str, limit: int, truncate: bool) -> list[int]:
        """The text's ids with the tokenizer's own special tokens ([CLS] ... [SEP], <s> ...),
        as sentence-transformers encodes; cut to `limit` from the end when allowed."""
        tok = self.tokenizer.tokenizer
        ids = tok.encode(text).ids
        if len(ids) > limit:
            if not truncate:
                raise EmbedError(f"input length {len(ids)} exceeds maximum context length "
                                 f"{limit}")
            bare = tok.encode(text, add_special_tokens=False)
            bare.truncate(max(limit - tok.num_special_tokens_to_add(False), 1))
            ids = tok.post_process(bare).ids[:limit]
        return ids or [self.pad_id]

    def embed(self, texts: list[str], truncate: bool = True, dimensions: int | None = None,
              num_ctx: int | None = None) -> Embeddings:
        limit = min(num_ctx, self.max_tokens) if num_ctx else self.max_tokens
        batch = [self.tokens(text, limit, truncate) for text in texts]
        started = time.perf_counter_ns()
        vectors: list[list[float]] = [[] for _ in batch]
        for rows in forward_groups([len(ids) for ids in batch], self.forward_tokens):
            pooled = self.forward([batch[i] for i in rows], dimensions)
            for i, vector in zip(rows, pooled, strict=True):
                vectors[i] = vector
        return Embeddings(vectors, sum(len(row) for row in batch),
                          time.perf_counter_ns() - started if batch else 0)

    def forward(self, batch: list[list[int]], dimensions: int | None) -> list[list[float]]:
        """One right-padded forward over `batch`; its pooled, normalised vectors."""
        width = max(len(ids) for ids in batch)
        ids = mx.array([row + [self.pad_id] * (width - len(row)) for row in batch])
        mask = mx.array([[1] * len(row) + [0] * (width - len(row)) for row in batch])
        hidden = self.model.embed(ids, mask).astype(mx.float32)
        if dimensions is not None and dimensions > hidden.shape[-1]:
            raise EmbedError(f"dimensions {dimensions} exceeds the model's embedding length "
                             f"{hidden.shape[-1]}")
        vectors = normalise(pool(hidden, mask, self.mode), dimensions)
        out: list[list[float]] = vectors.tolist()  # type: ignore[assignment]
        return out


def forward_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of the batch grouped for forwards: by length, so rows of one forward pad
    little, and each group's padded size (rows x longest) within `budget` tokens."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_embedder(model: nn.Module, config: dict[str, Any], files: dict[str, bytes],
                   tokenizer: ModelTokenizer) -> Embedder | None:
    """An Embedder for an embedding architecture (its module's EMBEDDING_ARCHITECTURES);
    None for a model that generates."""
    archs = config.get("architectures") or [""]
    if not is_embedding_architecture(str(archs[0])):
        return None
    module = model_module(str(model.model_type))
    mode = pooling_mode(files, getattr(module, "DEFAULT_POOLING", "mean"))
    return Embedder(model, tokenizer, mode, int(getattr(model, "max_tokens", 512)))


def _pad_id(tokenizer: ModelTokenizer) -> int:
    name = tokenizer.special.get("pad_token") or ""
    found = tokenizer.tokenizer.token_to_id(name) if name else None
    return int(found) if found is not None else 0


def embedding_dimensions(value: Any) -> int | None:
    """A request's `dimensions`: None or a positive integer."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EmbedError("dimensions must be a positive integer")
    return value
