"""Tokenizer, templates (HF chat template, Modelfile TEMPLATE subset) and streaming
detokenization."""

from __future__ import annotations

import json

import pytest

from runner.go_template import GoTemplate, TemplateError
from runner.tokenizer import ModelTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def files(make_checkpoint) -> dict[str, bytes]:
    ckpt = make_checkpoint("llama")
    names = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")
    return {name: (ckpt / name).read_bytes() for name in names}


def _tokenizer(files, template=None, **overrides) -> ModelTokenizer:
    files = dict(files)
    if overrides:
        config = json.loads(files["tokenizer_config.json"]) | overrides
        files["tokenizer_config.json"] = json.dumps(config).encode()
    return ModelTokenizer(files, json.loads(files["config.json"]), template)


def test_hf_chat_template_renders_messages_with_generation_prompt(files):
    tok = _tokenizer(files)
    assert tok.render(MESSAGES) == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.render(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_hf_template_gets_tools_and_jinja_features_transformers_provides(files):
    template = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                "{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    tok = _tokenizer(files, chat_template=template)
    tools = [{"type": "function", "function": {"name": "now"}}]
    assert tok.render(MESSAGES, tools=tools) == (
        '{"type": "function", "function": {"name": "now"}}\nHi!')


def test_chat_template_jinja_file_wins_over_tokenizer_config(files):
    tok = ModelTokenizer({**files, "chat_template.jinja": b"[{{ messages[-1].content }}]"}, {})
    assert tok.render(MESSAGES) == "[Hi!]"


def test_eos_ids_come_from_generation_config_and_tokenizer_config(files):
    tok = _tokenizer(files)
    assert tok.eos_ids == {1, 3}


def test_encoding_adds_no_special_tokens_unless_configured(files):
    assert _tokenizer(files).encode("hello")[0] != 0
    assert _tokenizer(files, add_bos_token=True).encode("hello")[0] == 0


def test_modelfile_template_messages_form(files):
    template = ("{{- if .System }}<<{{ .System }}>>\n{{ end }}"
                "{{- range .Messages }}[{{ .Role }}] {{ .Content }}\n{{ end }}[assistant]")
    tok = _tokenizer(files, template)
    assert tok.render(MESSAGES) == ("<<Be brief.>>\n[system] Be brief.\n[user] Hi!\n"
                                    "[assistant]")


def test_modelfile_template_prompt_form_renders_each_turn_and_stops_at_response():
    template = GoTemplate("{{ if .System }}S:{{ .System }} {{ else }}-{{ end }}"
                          "U:{{ .Prompt }} A:{{ .Response }}</s>")
    turns = [*MESSAGES, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye"}]
    assert template.render(turns) == "S:Be brief. U:Hi! A:Hello.</s>-U:Bye A:"


@pytest.mark.parametrize("source", ["{{ template \"x\" }}", "{{ if .System }}open",
                                    "{{ define \"x\" }}{{ end }}", "{{ nosuchfunc .Prompt }}",
                                    "{{ end }}", "{{ .Prompt", "{{ range .Messages }}{{ else if "
                                    ".X }}{{ end }}", "{{/* open comment }}"])
def test_unsupported_template_is_a_clear_error(source):
    with pytest.raises(TemplateError, match="template"):
        GoTemplate(source)


def test_streaming_detokenizer_never_splits_a_utf8_character(files):
    tok = _tokenizer(files)
    text = "naïve café — 日本語 ok 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces: characters span tokens
    detok = tok.detokenizer()
    pieces = [detok.add(token) for token in ids] + [detok.flush()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
