"""Tokenizer, chat templates and streaming detokenization for one model.

`tokenizer.json` goes through the `tokenizers` library; special tokens come from
`tokenizer_config.json`, EOS ids from `generation_config.json` and `config.json` as well (models
list several: `<|im_end|>` ends a chat turn, `<|end_of_text|>` a document). Prompts are rendered
by the model's Modelfile TEMPLATE when it has one (the Go template subset in go_template.py),
else by its Hugging Face chat template with jinja2 configured exactly as transformers does it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from runner.go_template import GoTemplate


class PromptError(ValueError):
    """A request's messages cannot be turned into a prompt for this model."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def hf_environment() -> jinja2.Environment:
    """The jinja2 environment transformers' `apply_chat_template` compiles templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(files: dict[str, bytes], tok_config: dict[str, Any]) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class ModelTokenizer:
    def __init__(self, files: dict[str, bytes], config: dict[str, Any],
                 modelfile_template: str | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """`tokenizer`: the object `tokenizer.json` was serialized from, where the caller has
        it (a GGUF's, built from its metadata), so the JSON is not parsed again."""
        if "tokenizer.json" not in files:
            raise PromptError("model has no tokenizer.json layer")
        self.tokenizer = tokenizer or Tokenizer.from_str(files["tokenizer.json"].decode())
        tok_config = json.loads(files.get("tokenizer_config.json", b"{}"))
        gen_config = json.loads(files.get("generation_config.json", b"{}"))
        self.special = {key: _token_text(tok_config.get(key)) or "" for key in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.add_bos = bool(tok_config.get("add_bos_token", False))
        self.eos_ids = _ids(gen_config.get("eos_token_id")) | _ids(config.get("eos_token_id"))
        eos_id = self.tokenizer.token_to_id(self.special["eos_token"] or "")
        if eos_id is not None:
            self.eos_ids.add(eos_id)
        self.go_template = GoTemplate(modelfile_template) if modelfile_template else None
        source = _chat_template(files, tok_config)
        self.hf_template = hf_environment().from_string(source) if source else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of an already rendered prompt; templates place special tokens themselves,
        so only a tokenizer configured with add_bos_token gets a BOS prepended here."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.tokenizer.token_to_id(self.special["bos_token"] or "")
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = True, think: bool | str | None = None,
               suffix: str = "", template: GoTemplate | None = None) -> str:
        """The prompt text for a conversation: `template` (a request's override), else the
        Modelfile TEMPLATE, else the HF template; `suffix` fills a Go template's `.Suffix`.

        `think` reaches Hugging Face templates as `enable_thinking` (Qwen3's switch) and, as a
        level, `reasoning_effort` (gpt-oss); unset, the template's own default stands."""
        go_template = template or self.go_template
        if go_template is not None:
            return go_template.render(messages, suffix, tools=tools, think=think)
        if self.hf_template is None:
            return "".join(str(m.get("content") or "") for m in messages)
        extra: dict[str, Any] = {}
        if think is not None:
            extra["enable_thinking"] = think is not False
        if isinstance(think, str):
            extra["reasoning_effort"] = think
        try:
            return self.hf_template.render(messages=messages, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           **self.special, **extra)
        except jinja2.exceptions.TemplateError as exc:
            raise PromptError(f"chat template failed: {exc}") from exc

    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Turns a growing token list into text pieces that never split a UTF-8 character.

    Decodes a small window (from the previous emit point) instead of the whole sequence; text
    ending in U+FFFD is an incomplete byte sequence and is held until the next token completes it.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix_text = self._tok.decode(self.tokens[self._prefix:self._read])
        text = self._tok.decode(self.tokens[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """What is still held at the end (an incomplete character is emitted as U+FFFD)."""
        prefix_text = self._tok.decode(self.tokens[self._prefix:self._read])
        text = self._tok.decode(self.tokens[self._prefix:])
        self._prefix = self._read = len(self.tokens)
        return text[len(prefix_text):]
