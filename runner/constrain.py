"""Constrained decoding: a JSON grammar masks the logits so that every answer parses.

llguidance compiles `format: "json"` (any object or array) or a JSON schema against the model's
own `tokenizers` vocabulary and, after each sampled token, computes which tokens may come next
(a fraction of a millisecond on the fixtures; the mask is computed while the model's forward
pass runs, see generate.py). We chose it over xgrammar (which needs torch and triton) and
outlines-core (a regex index built per schema, no unbounded nesting for plain "json").
Separators are fixed (`", "`, `": "`, no other whitespace) so that a model cannot spend its
budget on blank space; once the value is complete only EOS is allowed.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from runner.tokenizer import ModelTokenizer

ANY_JSON: dict[str, Any] = {"type": ["object", "array"]}
_OPTIONS: Any = {  # llguidance.JsonCompileOptions (a TypedDict its stubs alone define)
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
    "lenient": True}


class FormatError(ValueError):
    """A `format` that is neither "json" nor a schema the grammar compiler accepts."""


class GrammarCompiler:
    """Builds matchers for one model's vocabulary (the vocabulary is converted once, lazily)."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None

    def _vocabulary(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            tok = self.tokenizer.tokenizer
            self._ll = llguidance.LLTokenizer(
                tok.to_str(), n_vocab=tok.get_vocab_size(with_added_tokens=True),
                eos_token=sorted(self.tokenizer.eos_ids) or None)
        return self._ll

    def constraint(self, fmt: Any) -> TokenConstraint:
        """The per-request state for `fmt` ("json", a schema object, or its JSON text)."""
        schema = ANY_JSON if fmt == "json" else fmt
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise FormatError(f"format is neither \"json\" nor a JSON schema: {exc}") from exc
        if not isinstance(schema, dict):
            raise FormatError('format must be "json" or a JSON schema object')
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_OPTIONS)
        except ValueError as exc:
            raise FormatError(f"format is not a usable JSON schema: {exc}") from exc
        matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0)
        if matcher.is_error():
            raise FormatError(f"format is not a usable JSON schema: {matcher.get_error()}")
        return TokenConstraint(matcher, sorted(self.tokenizer.eos_ids))


class TokenConstraint:
    """One request's grammar state: the mask for the next token, then the token it got."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: list[int]) -> None:
        self.matcher = matcher
        self.eos_ids = eos_ids

    def allowed(self, vocab: int) -> mx.array:
        """A bool mask of `vocab` entries (the logits' width, which may exceed the tokenizer's).

        When the grammar has failed or finished, only EOS remains allowed."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            mask = np.zeros(vocab, dtype=bool)
            mask[[i for i in self.eos_ids if i < vocab]] = True
            return mx.array(mask)
        bias = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)
        mask = np.zeros(vocab, dtype=bool)
        width = min(vocab, bias.size)
        mask[:width] = bias[:width] > 0
        return mx.array(mask)

    def accept(self, token: int) -> None:
        if token not in self.eos_ids:
            self.matcher.consume_token(token)
