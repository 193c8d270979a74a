"""Tool calls in a model's answer, in the shapes chat templates teach models to write them.

The runner returns text; when a request offers `tools`, the model server reads calls out of the
whole answer: `<tool_call>{...}</tool_call>` (Qwen, Hermes), `[TOOL_CALLS] [...]` (Mistral), or
a bare JSON object or list with `name` and `arguments` (or `parameters`, Llama 3). Only names the
request offered count, so prose that happens to contain JSON stays prose.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"
_NEMOTRON_JSON = re.compile(r"<TOOLCALL>\s*(.*?)\s*(?:</TOOLCALL>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call; `index` is its place in the answer, `id` what a tool result answers (/v1)."""

    name: str
    arguments: dict[str, Any]
    index: int = 0
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(6)}", compare=False)

    def ollama(self) -> dict[str, Any]:
        return {"id": self.id, "function": {"index": self.index, "name": self.name,
                                            "arguments": self.arguments}}

    def numbered(self, index: int) -> ToolCall:
        return replace(self, index=index)


def tool_names(tools: Any) -> dict[str, dict[str, Any]]:
    """The function names a request's `tools` list offers, each with its parameters' JSON-schema
    `properties` (what a call format without JSON types, Nemotron's XML, types arguments by)."""
    names: dict[str, dict[str, Any]] = {}
    for tool in tools if isinstance(tools, list) else []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            properties = params.get("properties") if isinstance(params, dict) else None
            names[function["name"]] = properties if isinstance(properties, dict) else {}
    return names


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """(the text left once calls are removed, the calls) for an answer offered `names`."""
    if not names:
        return text, []
    tagged = _TAGGED.findall(text)
    if tagged:
        calls = [c for body in tagged for c in _calls(_load(body), names)]
        if calls:
            return _TAGGED.sub("", text).strip(), calls
    if _MISTRAL in text:
        before, _, after = text.partition(_MISTRAL)
        calls = _calls(_load(after), names)
        if calls:
            return before.strip(), calls
    stripped = text.strip().removeprefix("<|python_tag|>")
    calls = _calls(_load(stripped), names)
    return ("", calls) if calls else (text, [])


def _load(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _calls(value: Any, names: Collection[str]) -> list[ToolCall]:
    """Calls from a decoded object or list; empty if any entry is not a call to a known name."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return []
        item = item.get("function", item) if isinstance(item.get("function"), dict) else item
        name = item.get("name")
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _load(arguments)
        if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(name, arguments))
    return calls


def parse_nemotron_calls(text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """Nemotron's calls: `<TOOLCALL>[{"name", "arguments"}, ...]</TOOLCALL>` (Nano v2) and
    `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
    (Nemotron 3, Qwen3-Coder's markup). A closing tag cut off by the end of the answer is
    forgiven; any block that is not a call to an offered name leaves the whole text as text."""
    if not names:
        return text, []
    calls: list[ToolCall] = []
    for body in _NEMOTRON_JSON.findall(text):
        calls += _calls(_load(body), names) or [_NOT_A_CALL]
    for body in _TAGGED.findall(text):
        calls += _xml_calls(body, names) or _calls(_load(body), names) or [_NOT_A_CALL]
    if not calls or _NOT_A_CALL in calls:
        return text, []
    return _TAGGED.sub("", _NEMOTRON_JSON.sub("", text)).strip(), calls


_NOT_A_CALL = ToolCall("", {}, id="")


def _xml_calls(body: str, names: Collection[str]) -> list[ToolCall]:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        if name.strip() not in names:
            return []
        schema = names.get(name.strip()) if isinstance(names, Mapping) else None
        arguments = {key.strip(): _xml_value(value, _declared_type(schema, key.strip()))
                     for key, value in _PARAMETER.findall(inner)}
        calls.append(ToolCall(name.strip(), arguments))
    return calls


def _declared_type(schema: Any, key: str) -> Any:
    prop = schema.get(key) if isinstance(schema, dict) else None
    return prop.get("type") if isinstance(prop, dict) else None


def _xml_value(raw: str, declared: Any = None) -> Any:
    """A parameter's text, one newline trimmed each side. A parameter the tool declares a
    string stays text ("123" stays "123"); otherwise JSON literals (numbers, booleans, null,
    objects, lists) are decoded, else it is text."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if declared == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
