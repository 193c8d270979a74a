"""The subset of Go's text/template that Modelfile TEMPLATEs commonly use.

Supported: `{{ .System }}`, `{{ .Prompt }}`, `{{ .Suffix }}` (fill-in-the-middle: the text
after the cursor), `{{ .Response }}`, `{{ range .Messages }}` with
`{{ .Role }}` / `{{ .Content }}` inside (and `$.System` etc. for the root), `{{ if X }}` /
`{{ else }}` / `{{ end }}`, comments `{{/* */}}`, and the `{{-` / `-}}` whitespace trims.
Anything else is a `TemplateError` that names the action, so a model whose template needs more
fails at load with a clear message instead of rendering a wrong prompt.

Rendering follows Ollama's `template.Execute`: a template that ranges over `.Messages` gets them
all; one that does not is executed once per turn (system, prompt, response), and the last turn
stops right where `{{ .Response }}` would be written, so the model continues from there.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.DOTALL)
_FIELD = re.compile(r"^(\$)?\.([A-Za-z_][A-Za-z0-9_]*)$")
ROOT_FIELDS = frozenset({"System", "Prompt", "Response", "Messages", "Suffix"})
MESSAGE_FIELDS = frozenset({"Role", "Content"})


class TemplateError(ValueError):
    """The template uses Go template syntax outside the supported subset."""


@dataclass
class Node:
    kind: str  # text | field | if | range
    text: str = ""
    name: str = ""
    rooted: bool = False
    body: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)


class _StopAtResponse(Exception):
    pass


def _field(expr: str, action: str) -> tuple[str, bool]:
    match = _FIELD.match(expr.strip())
    if not match or match.group(2) not in ROOT_FIELDS | MESSAGE_FIELDS:
        raise TemplateError(
            f"unsupported template action {{{{ {action} }}}}: ferry supports .System, .Prompt, "
            ".Response, range .Messages (.Role, .Content), if/else/end")
    return match.group(2), bool(match.group(1))


def _lex(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", a) tokens with the trim markers already applied."""
    tokens: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for match in _ACTION.finditer(source):
        text = source[pos:match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        tokens += [("text", text), ("action", match.group(2))]
        pos, trim_next = match.end(), bool(match.group(3))
    tail = source[pos:]
    tokens.append(("text", tail.lstrip() if trim_next else tail))
    return tokens


def parse(source: str) -> list[Node]:
    nodes, _ = _parse_block(_lex(source), 0, top=True)
    return nodes


def _parse_block(tokens: list[tuple[str, str]], i: int, top: bool = False
                 ) -> tuple[list[Node], int]:
    """Parse until `end`/`else` (returned index points at it) or the end of input."""
    nodes: list[Node] = []
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "text":
            if value:
                nodes.append(Node("text", text=value))
        elif value.startswith("/*"):
            pass
        elif value in ("end", "else"):
            if top:
                raise TemplateError(f"unexpected {{{{ {value} }}}} in template")
            return nodes, i
        elif value.startswith(("if ", "range ")):
            node, i = _parse_control(tokens, i, value)
            nodes.append(node)
        else:
            name, rooted = _field(value, value)
            nodes.append(Node("field", name=name, rooted=rooted))
        i += 1
    if not top:
        raise TemplateError("template has an unclosed {{ if }} or {{ range }}")
    return nodes, i


def _parse_control(tokens: list[tuple[str, str]], i: int, action: str) -> tuple[Node, int]:
    keyword, _, expr = action.partition(" ")
    name, rooted = _field(expr, action)
    if keyword == "range" and name != "Messages":
        raise TemplateError(f"unsupported template action {{{{ {action} }}}}: only "
                            "range .Messages is supported")
    node = Node(keyword, name=name, rooted=rooted)
    node.body, i = _parse_block(tokens, i + 1)
    if tokens[i][1] == "else":
        node.orelse, i = _parse_block(tokens, i + 1)
        if tokens[i][1] != "end":
            raise TemplateError("template has an {{ else }} without its {{ end }}")
    return node, i


class GoTemplate:
    def __init__(self, source: str) -> None:
        self.nodes = parse(source)
        self.uses_messages = "Messages" in _names(self.nodes)

    def render(self, messages: list[dict[str, Any]], suffix: str = "") -> str:
        if self.uses_messages:
            system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
            root = {"System": system, "Prompt": "", "Response": "", "Messages": messages,
                    "Suffix": suffix}
            return self._execute(root, stop_at_response=False)
        turns = _turns(messages)
        out = [self._execute(turn, stop_at_response=False) for turn in turns[:-1]]
        out.append(self._execute({**turns[-1], "Suffix": suffix}, stop_at_response=True))
        return "".join(out)

    def _execute(self, root: dict[str, Any], stop_at_response: bool) -> str:
        out: list[str] = []
        with contextlib.suppress(_StopAtResponse):
            _render(self.nodes, root, root, out, stop_at_response)
        return "".join(out)


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collapse messages into (System, Prompt, Response) turns, as Ollama does."""
    turns: list[dict[str, Any]] = []
    cur = {"System": "", "Prompt": "", "Response": "", "Suffix": ""}
    for m in messages:
        role, content = m.get("role"), str(m.get("content") or "")
        if (role == "system" and (cur["Prompt"] or cur["Response"])) or (
                role == "user" and cur["Response"]):
            turns.append(cur)
            cur = {"System": "", "Prompt": "", "Response": "", "Suffix": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(str(role))
        if key:
            cur[key] = content
    turns.append(cur)
    return turns


def _names(nodes: list[Node]) -> set[str]:
    found: set[str] = set()
    for node in nodes:
        found.add(node.name)
        found |= _names(node.body) | _names(node.orelse)
    return found


def _lookup(node: Node, dot: dict[str, Any], root: dict[str, Any]) -> Any:
    scope = root if node.rooted else dot
    key = node.name.lower() if scope is not root else node.name
    if key not in scope:
        raise TemplateError(f"template field .{node.name} is not defined here")
    return scope[key]


def _render(nodes: list[Node], dot: dict[str, Any], root: dict[str, Any], out: list[str],
            stop_at_response: bool) -> None:
    for node in nodes:
        if node.kind == "text":
            out.append(node.text)
        elif node.kind == "field":
            if stop_at_response and node.name == "Response" and dot is root:
                raise _StopAtResponse
            out.append(str(_lookup(node, dot, root) or ""))
        elif node.kind == "if":
            branch = node.body if _lookup(node, dot, root) else node.orelse
            _render(branch, dot, root, out, stop_at_response)
        else:
            for message in _lookup(node, dot, root) or []:
                item = {"role": message.get("role", ""), "content": message.get("content") or ""}
                _render(node.body, item, root, out, stop_at_response)
