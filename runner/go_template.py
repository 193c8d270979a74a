"""Go's text/template, as Modelfile TEMPLATEs use it, rendered the way Ollama renders them.

The language: `{{ pipeline }}` actions with `{{-`/`-}}` trims and `{{/* comments */}}`;
`if`/`else if`/`else`/`end`, `range` (over lists, maps and integers, with `$i, $v :=`, `break`,
`continue` and an `else` for an empty range) and `with`; variables (`$`, `$x := …`, `$x = …`);
field chains (`.Function.Name`, `$.Tools`, `$m.Content`, `(index .Messages 0).Role`); pipes
(`.X | json`); string, raw-string, number, bool and nil literals; and Go's built-in functions
(`and`, `or` — both short-circuit —, `not`, `eq` with several operands, `ne`, `lt`, `le`, `gt`,
`ge`, `len`, `index`, `slice`, `print`, `printf`, `println`) plus Ollama's `json`, `currentDate`
and `yesterdayDate`. Named templates (`define`, `template`, `block`) and method calls are refused
with a `TemplateError` naming the action, so a template that needs them fails at load instead
of rendering a wrong prompt.

The data follows Ollama's `template.Values`: `.System`, `.Messages` (collated: consecutive
messages of one role merged, except tool results; each with `.Role`, `.Content`, `.Thinking`,
`.ToolCalls` (`.Function.Name`, `.Function.Arguments`, `.Function.Index`, `.ID`), `.ToolName`,
`.ToolCallID`), `.Tools` (`.Type`, `.Function.Name`, `.Function.Description`,
`.Function.Parameters.Properties` …), `.Think`, `.IsThinkSet`, `.Prompt`, `.Suffix`, `.Response`.
Tools, tool functions, parameters and call arguments print as Go's `json.Marshal` writes them
(struct field order, `omitempty`, `<>&` escaped), because Ollama's types print that way.

Rendering follows Ollama's `template.Execute`: a prompt with a suffix renders once (fill in the
middle); a template that uses `.Messages` gets them all; any other is executed once per turn
(system, prompt, response), and the last turn stops right where `{{ .Response }}` would be
written, so the model continues from there.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# A template may come with a request (/api/generate's `template`), so rendering is bounded:
_MAX_DEPTH = 64  # nested control structures and parentheses
MAX_OUTPUT = 16 * 1024 * 1024  # characters a render (or one string it builds) may reach
MAX_STEPS = 1_000_000  # nodes a render may execute (a `range 1000000000` with no output)


class TemplateError(ValueError):
    """The template is not valid Go template syntax, or uses what ferry does not support."""


# -- values with Go's printing -----------------------------------------------------------------

def go_json(value: Any) -> str:
    """`json.Marshal` output: compact, non-ASCII kept, and `<`, `>`, `&`, U+2028/9 escaped."""
    text = json.dumps(_plain(value), ensure_ascii=False, separators=(",", ":"))
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class JSONObject(dict[str, Any]):
    """A Go value whose String() method is its JSON (api.Tool, api.ToolFunction, arguments)."""

    def __str__(self) -> str:
        return go_json(self)


class JSONList(list[Any]):
    """api.Tools: a list that prints as JSON."""

    def __str__(self) -> str:
        return go_json(self)


def _ordered(source: Any, keys: tuple[str, ...], required: tuple[str, ...] = ()) -> JSONObject:
    """A struct's JSON: `keys` in field order; absent or empty fields omitted unless required."""
    data = source if isinstance(source, dict) else {}
    out = JSONObject()
    for key in keys:
        value = data.get(key)
        if key in required or value not in (None, "", [], {}):
            out[key] = value
    return out


def _property(source: Any) -> Any:
    if not isinstance(source, dict):
        return source
    prop = _ordered(source, ("anyOf", "type", "items", "description", "enum", "properties",
                             "required"))
    if isinstance(prop.get("anyOf"), list):
        prop["anyOf"] = [_property(p) for p in prop["anyOf"]]
    if isinstance(prop.get("properties"), dict):
        prop["properties"] = JSONObject({k: _property(v) for k, v in prop["properties"].items()})
    return prop


def tool_value(tool: Any) -> JSONObject:
    """An OpenAI-style tool object shaped as Ollama's api.Tool."""
    out = _ordered(tool, ("type", "items", "function"), required=("type", "function"))
    out["type"] = out.get("type") or ""
    function = _ordered(out.get("function"), ("name", "description", "parameters"),
                        required=("name", "parameters"))
    function["name"] = function.get("name") or ""
    params = _ordered(function.get("parameters"), ("type", "$defs", "items", "required",
                                                    "properties"),
                      required=("type", "properties"))
    params["type"] = params.get("type") or ""
    properties = params.get("properties")
    params["properties"] = (JSONObject({k: _property(v) for k, v in properties.items()})
                            if isinstance(properties, dict) else None)
    function["parameters"] = params
    out["function"] = function
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    data = call if isinstance(call, dict) else {}
    function: dict[str, Any] = data["function"] if isinstance(data.get("function"), dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI clients send arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    return {"id": data.get("id") or "",
            "function": {"index": function.get("index") or 0, "name": function.get("name") or "",
                         "arguments": JSONObject(arguments if isinstance(arguments, dict)
                                                 else {})}}


def message_value(message: dict[str, Any]) -> dict[str, Any]:
    """An api.Message: every field present (Go's zero values), tool calls shaped as Ollama's."""
    calls = message.get("tool_calls")
    return {"role": str(message.get("role") or "").lower(),
            "content": str(message.get("content") or ""),
            "thinking": str(message.get("thinking") or ""),
            "images": list(message.get("images") or []),
            "tool_calls": [_tool_call(c) for c in calls] if isinstance(calls, list) else [],
            "tool_name": str(message.get("tool_name") or message.get("name") or ""),
            "tool_call_id": str(message.get("tool_call_id") or "")}


def collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: the joined system messages, and consecutive same-role messages merged
    (tool results stay one per message)."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for raw in messages:
        message = message_value(raw)
        if message["role"] == "system":
            system.append(message["content"])
        if out and out[-1]["role"] == message["role"] and message["role"] != "tool":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + message["content"]}
        else:
            out.append(message)
    return "\n\n".join(system), out


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _field_of(value: Any, name: str, action: str) -> Any:
    """`.Name` on a value: Go map keys as written, struct fields by their JSON names."""
    if isinstance(value, dict):
        if name in value:
            return value[name]
        for key in (_snake(name), name[:1].lower() + name[1:]):
            if key in value:
                return value[key]
        return None
    if value is None:
        return None
    raise TemplateError(f"template action {{{{ {action} }}}}: can't read field {name} of "
                        f"{type(value).__name__} {_print(value)!r}")


# -- printing and truth (fmt %v and Go's template truth) -----------------------------------------

def _print(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, JSONObject | JSONList):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value != int(value) or abs(value) >= 1e21 else str(int(value))
    if isinstance(value, list | tuple):
        return "[" + " ".join(_print(v) for v in value) + "]"
    if isinstance(value, dict):
        return go_json(value)
    return str(value)


def truth(value: Any) -> bool:
    return bool(value) if value is not None else False


# -- lexing ---------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<char>'(?:[^'\\]|\\.)+')
  | (?P<declare>:=)
  | (?P<assign>=)
  | (?P<punct>[()|,])
  | (?P<number>[-+]?(?:0[xX][0-9a-fA-F_]+|(?:\d[\d_]*)?\.?\d[\d_]*(?:[eE][-+]?\d+)?))
  | (?P<variable>\$[A-Za-z0-9_]*)
  | (?P<fields>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
""", re.VERBOSE)
_CHAIN = re.compile(r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


@dataclass
class Token:
    kind: str
    text: str


def _lex_action(action: str) -> list[Token]:
    tokens: list[Token] = []
    pos = 0
    while pos < len(action):
        match = _TOKEN.match(action, pos)
        if match is None:
            raise TemplateError(f"template action {{{{ {action} }}}}: unexpected "
                                f"{action[pos:pos + 10]!r}")
        kind = match.lastgroup or ""
        text = match.group()
        pos = match.end()
        if kind == "space":
            continue
        # `$x.Field` and `(…).Field`: a chain glued to what precedes it.
        if kind in ("variable", "punct") and (kind == "variable" or text == ")"):
            chain = _CHAIN.match(action, pos)
            if chain:
                tokens.append(Token(kind, text))
                tokens.append(Token("chain", chain.group()))
                pos = chain.end()
                continue
        tokens.append(Token(kind, text))
    return tokens


def _split(source: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", a) pieces with the trim markers applied; `}}` inside a quoted
    string does not end an action."""
    pieces: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    while True:
        start = source.find("{{", pos)
        text = source[pos:] if start < 0 else source[pos:start]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if start < 0:
            pieces.append(("text", text))
            return pieces
        inner = start + 2
        trim_left = source.startswith("- ", inner) or source.startswith("-\t", inner) or \
            source.startswith("-\n", inner) or source.startswith("-\r", inner)
        if trim_left:
            text = text.rstrip(" \t\r\n")
            inner += 1
        if source[inner:].lstrip().startswith("/*"):  # a comment may hold quotes and braces
            close = source.find("*/", inner)
            end = source.find("}}", close) if close >= 0 else -1
            if end < 0 or source[close + 2:end].strip() not in ("", "-"):
                raise TemplateError("template has an unclosed comment {{/*")
        else:
            end = _action_end(source, inner)
        body = source[inner:end]
        trim_next = body.endswith((" -", "\t-", "\n-", "\r-"))
        if trim_next:
            body = body[:-1]
        pieces += [("text", text), ("action", body.strip())]
        pos = end + 2


def _action_end(source: str, pos: int) -> int:
    quote = ""
    while pos < len(source):
        char = source[pos]
        if quote:
            if char == "\\" and quote != "`":
                pos += 1
            elif char == quote:
                quote = ""
        elif char in "\"`'":
            quote = char
        elif source.startswith("}}", pos):
            return pos
        pos += 1
    raise TemplateError("template has an unclosed action: a {{ without its }}")


# -- parsing -------------------------------------------------------------------------------

@dataclass
class Pipe:
    """`$a, $b := cmd | cmd …`; each command is a list of operands."""

    commands: list[list[Any]]
    declare: list[str] = field(default_factory=list)
    assign: bool = False  # `=` (set an existing variable) rather than `:=`


@dataclass
class Operand:
    kind: str  # literal | field | variable | ident | pipe | dot
    value: Any = None
    chain: list[str] = field(default_factory=list)


@dataclass
class Node:
    kind: str  # text | action | if | range | with | break | continue
    text: str = ""
    pipe: Pipe | None = None
    body: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)


def _unquote(token: Token) -> Any:
    if token.kind == "raw":
        return token.text[1:-1]
    if token.kind == "char":
        return ord(json.loads('"' + token.text[1:-1].replace('"', '\\"') + '"'))
    try:
        return json.loads(token.text)
    except ValueError as exc:
        raise TemplateError(f"bad string literal {token.text}") from exc


def _number(text: str) -> int | float:
    clean = text.replace("_", "")
    try:
        return int(clean, 0)
    except ValueError:
        return float(clean)


class _Parser:
    def __init__(self, source: str) -> None:
        self.pieces = _split(source)
        self.pos = 0
        self.depth = 0
        self.names: set[str] = set()

    def parse(self) -> list[Node]:
        nodes, stop = self._list()
        if stop is not None:
            raise TemplateError(f"unexpected {{{{ {stop} }}}} in template")
        return nodes

    def _list(self) -> tuple[list[Node], str | None]:
        """Nodes until `end`/`else…` (returned, consumed) or the end of the template (None)."""
        nodes: list[Node] = []
        while self.pos < len(self.pieces):
            kind, value = self.pieces[self.pos]
            self.pos += 1
            if kind == "text":
                if value:
                    nodes.append(Node("text", text=value))
                continue
            if value.startswith("/*"):
                continue
            word = value.split(None, 1)[0] if value else ""
            if word == "end" or word == "else":
                return nodes, value
            if word in ("if", "range", "with"):
                nodes.append(self._control(word, value[len(word):].strip(), value))
            elif word in ("break", "continue") and value == word:
                nodes.append(Node(word))
            elif word in ("define", "template", "block"):
                raise TemplateError(f"unsupported template action {{{{ {value} }}}}: named "
                                    "templates are not supported")
            elif not value:
                raise TemplateError("template has an empty action {{ }}")
            else:
                nodes.append(Node("action", pipe=self._pipe(value, value)))
        return nodes, None

    def _control(self, word: str, expr: str, action: str) -> Node:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise TemplateError(f"template nests deeper than {_MAX_DEPTH} levels")
        node = Node(word, pipe=self._pipe(expr, action))
        node.body, stop = self._list()
        if stop is None:
            raise TemplateError(f"template has an unclosed {{{{ {word} }}}}")
        if stop.startswith("else"):
            rest = stop[4:].strip()
            if rest:  # `else if X` / `else with X`: a nested control that shares our `end`
                nested_word = rest.split(None, 1)[0]
                if nested_word != word or word == "range":  # else if / else with only
                    raise TemplateError(f"unexpected {{{{ {stop} }}}} in template")
                node.orelse = [self._control(nested_word, rest[len(nested_word):].strip(),
                                             stop)]
                self.depth -= 1
                return node
            node.orelse, stop = self._list()
            if stop != "end":
                raise TemplateError(f"template has an {{{{ else }}}} without its {{{{ end }}}} "
                                    f"in {{{{ {action} }}}}")
        elif stop != "end":
            raise TemplateError(f"unexpected {{{{ {stop} }}}} in template")
        self.depth -= 1
        return node

    def _pipe(self, expr: str, action: str) -> Pipe:
        tokens = _lex_action(expr)
        if not tokens:
            raise TemplateError(f"template action {{{{ {action} }}}} has no value")
        declare: list[str] = []
        assign = False
        # `$x :=`, `$i, $v :=`, `$x =`
        for index, token in enumerate(tokens[:4]):
            if token.kind in ("declare", "assign"):
                names = tokens[:index]
                ok = all(t.kind == "variable" for t in names[::2]) and \
                    all(t.kind == "punct" and t.text == "," for t in names[1::2])
                if not names or not ok or len(names) > 3:
                    raise TemplateError(f"template action {{{{ {action} }}}}: bad declaration")
                declare = [t.text for t in names[::2]]
                assign = token.kind == "assign"
                tokens = tokens[index + 1:]
                break
        pipe, rest = self._commands(tokens, action, 0)
        if rest:
            raise TemplateError(f"template action {{{{ {action} }}}}: unexpected "
                                f"{rest[0].text!r}")
        pipe.declare, pipe.assign = declare, assign
        return pipe

    def _commands(self, tokens: list[Token], action: str, depth: int
                  ) -> tuple[Pipe, list[Token]]:
        if depth > _MAX_DEPTH:
            raise TemplateError(f"template action {{{{ {action} }}}} nests too deeply")
        commands: list[list[Any]] = [[]]
        while tokens:
            token = tokens[0]
            if token.kind == "punct" and token.text == ")":
                break
            tokens = tokens[1:]
            if token.kind == "punct" and token.text == "|":
                if not commands[-1]:
                    raise TemplateError(f"template action {{{{ {action} }}}}: empty command")
                commands.append([])
            elif token.kind == "punct" and token.text == "(":
                inner, tokens = self._commands(tokens, action, depth + 1)
                if not tokens or tokens[0].text != ")":
                    raise TemplateError(f"template action {{{{ {action} }}}}: unclosed (")
                tokens = tokens[1:]
                operand = Operand("pipe", inner)
                if tokens and tokens[0].kind == "chain":
                    operand.chain = tokens[0].text[1:].split(".")
                    tokens = tokens[1:]
                commands[-1].append(operand)
            else:
                commands[-1].append(self._operand(token, tokens, action))
                if token.kind == "variable" and tokens and tokens[0].kind == "chain":
                    commands[-1][-1].chain = tokens[0].text[1:].split(".")
                    tokens = tokens[1:]
        if not commands[-1]:
            raise TemplateError(f"template action {{{{ {action} }}}}: missing value")
        return Pipe(commands), tokens

    def _operand(self, token: Token, rest: list[Token], action: str) -> Operand:
        if token.kind in ("string", "raw", "char"):
            return Operand("literal", _unquote(token))
        if token.kind == "number":
            return Operand("literal", _number(token.text))
        if token.kind == "variable":
            return Operand("variable", token.text)
        if token.kind == "fields":
            if token.text == ".":
                return Operand("dot")
            chain = token.text[1:].split(".")
            self.names.update(chain)
            return Operand("field", chain=chain)
        if token.kind == "ident":
            literal = {"true": True, "false": False, "nil": None}
            if token.text in literal:
                return Operand("literal", literal[token.text])
            if token.text not in FUNCTIONS:
                raise TemplateError(f"template action {{{{ {action} }}}}: function "
                                    f"{token.text!r} not defined")
            return Operand("ident", token.text)
        raise TemplateError(f"template action {{{{ {action} }}}}: unexpected {token.text!r}")


# -- functions -----------------------------------------------------------------------------

def _eq(first: Any, *others: Any) -> bool:
    if not others:
        raise TemplateError("eq needs at least two arguments")
    return any(first == other for other in others)


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        if value is None:
            return None
        try:
            value = value.get(key) if isinstance(value, dict) else value[key]
        except (IndexError, TypeError) as exc:
            raise TemplateError(f"index {key!r} out of range") from exc
    return value


def _slice(value: Any, *bounds: int) -> Any:
    if len(bounds) > 2:
        raise TemplateError("slice with three indices is not supported")
    start = bounds[0] if bounds else 0
    stop = bounds[1] if len(bounds) > 1 else len(value)
    if not 0 <= start <= stop <= len(value):
        raise TemplateError(f"slice bounds [{start}:{stop}] out of range for length "
                            f"{len(value)}")
    return value[start:stop]


def _len(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str | list | tuple | dict):
        return len(value)
    raise TemplateError(f"len of {type(value).__name__}")


def _printf(form: str, *args: Any) -> str:
    values = iter(args)

    def verb(match: re.Match[str]) -> str:
        spec, kind = match.group(1), match.group(2)
        if kind == "%":
            return "%"
        value = next(values, None)
        if kind == "q":
            return json.dumps(_print(value), ensure_ascii=False)
        if kind in "dxXobeEfFgG" and isinstance(value, int | float) \
                and not isinstance(value, bool):
            return ("%" + spec + kind) % value
        return ("%" + spec + "s") % _print(value)

    # widths and precisions of at most 3 digits: a longer one is left as text, not honoured
    return re.sub(r"%([-+ #0]*\d{0,3}(?:\.\d{1,3})?)([vsdqtxXobeEfFgG%])", verb, form)


def _print_args(*args: Any) -> str:
    out = ""
    for i, arg in enumerate(args):
        # Go's Sprint puts a space between operands when neither is a string
        if i and not isinstance(arg, str) and not isinstance(args[i - 1], str):
            out += " "
        out += _print(arg)
    return out


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "not": lambda value: not truth(value),
    "eq": _eq,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "len": _len,
    "index": _index,
    "slice": _slice,
    "print": _print_args,
    "printf": _printf,
    "println": lambda *args: " ".join(_print(a) for a in args) + "\n",
    "json": go_json,
    "currentDate": lambda: datetime.date.today().isoformat(),
    "yesterdayDate": lambda: (datetime.date.today() - datetime.timedelta(days=1)).isoformat(),
    "and": lambda *args: args[-1],  # evaluated lazily in _command; listed for the parser
    "or": lambda *args: args[-1],
}


# -- execution ------------------------------------------------------------------------------

class _Stop(Exception):
    """Raised at `{{ .Response }}` in the last turn of a prompt-form template."""


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class _State:
    def __init__(self, root: dict[str, Any], stop_at_response: bool) -> None:
        self.root = root
        self.stop_at_response = stop_at_response
        self.scopes: list[dict[str, Any]] = [{"$": root}]
        self.out: list[str] = []
        self.size = 0
        self.steps = 0

    def write(self, text: str) -> None:
        self.size += len(text)
        if self.size > MAX_OUTPUT:
            raise TemplateError(f"the template renders more than {MAX_OUTPUT} characters")
        self.out.append(text)

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateError(f"the template runs more than {MAX_STEPS} steps")

    def variable(self, name: str) -> Any:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise TemplateError(f"template variable {name} is not defined")

    def set(self, name: str, value: Any, declare: bool) -> None:
        if declare:
            self.scopes[-1][name] = value
            return
        for scope in reversed(self.scopes):
            if name in scope:
                scope[name] = value
                return
        raise TemplateError(f"template variable {name} is not defined")


def _run(nodes: list[Node], dot: Any, state: _State) -> None:
    for node in nodes:
        state.step()
        if node.kind == "text":
            state.write(node.text)
        elif node.kind == "action":
            assert node.pipe is not None
            value = _pipe_value(node.pipe, dot, state)
            if not node.pipe.declare:
                state.write(_print(value))
        elif node.kind in ("if", "with"):
            assert node.pipe is not None
            state.scopes.append({})  # a variable declared in the condition lives in the block
            try:
                value = _pipe_value(node.pipe, dot, state)
                if truth(value):
                    _scoped(node.body, value if node.kind == "with" else dot, state)
                else:
                    _scoped(node.orelse, dot, state)
            finally:
                state.scopes.pop()
        elif node.kind == "range":
            _range(node, dot, state)
        elif node.kind == "break":
            raise _Break
        else:
            raise _Continue


def _scoped(nodes: list[Node], dot: Any, state: _State,
            variables: dict[str, Any] | None = None) -> None:
    state.scopes.append(dict(variables or {}))
    try:
        _run(nodes, dot, state)
    finally:
        state.scopes.pop()


def _range(node: Node, dot: Any, state: _State) -> None:
    assert node.pipe is not None
    pipe = Pipe(node.pipe.commands)  # the declared names bind per item, not to the whole value
    value = _pipe_value(pipe, dot, state)
    items: Iterator[tuple[Any, Any]]
    if value is None:
        items = iter(())
    elif isinstance(value, dict):
        items = iter(list(value.items()))
    elif isinstance(value, list | tuple | str):
        items = enumerate(list(value))
    elif isinstance(value, int) and not isinstance(value, bool):
        items = ((i, i) for i in range(value))
    else:
        raise TemplateError(f"range can't iterate over {_print(value)!r}")
    names = node.pipe.declare
    ran = False
    for key, item in items:
        state.step()
        ran = True
        bound = {names[-1]: item} if len(names) == 1 else (
            {names[0]: key, names[1]: item} if len(names) == 2 else {})
        try:
            _scoped(node.body, item, state, bound)
        except _Break:
            break
        except _Continue:
            continue
    if not ran:
        _scoped(node.orelse, dot, state)


def _pipe_value(pipe: Pipe, dot: Any, state: _State) -> Any:
    value: Any = _NO_VALUE
    for command in pipe.commands:
        value = _command(command, dot, state, value)
    if pipe.declare:
        for name in pipe.declare:
            state.set(name, value, declare=not pipe.assign)
    return value


_NO_VALUE = object()


def _command(command: list[Operand], dot: Any, state: _State, piped: Any) -> Any:
    head = command[0]
    if head.kind == "ident":
        name = str(head.value)
        args = command[1:]
        if name in ("and", "or"):
            operands = [*args, *([] if piped is _NO_VALUE else [Operand("literal", piped)])]
            if not operands:
                raise TemplateError(f"{name} needs at least one argument")
            result: Any = None
            for operand in operands:
                result = _operand_value(operand, dot, state)
                if truth(result) == (name == "or"):
                    return result
            return result
        values = [_operand_value(a, dot, state) for a in args]
        if piped is not _NO_VALUE:
            values.append(piped)
        try:
            result = FUNCTIONS[name](*values)
        except TypeError as exc:
            raise TemplateError(f"template function {name}: {exc}") from exc
        if isinstance(result, str) and len(result) > MAX_OUTPUT:  # `$s = print $s $s` doubling
            raise TemplateError(f"the template builds a string over {MAX_OUTPUT} characters")
        return result
    if len(command) > 1 or piped is not _NO_VALUE:
        raise TemplateError("template method calls and piping into a value are not supported")
    return _operand_value(head, dot, state)


def _operand_value(operand: Operand, dot: Any, state: _State) -> Any:
    if operand.kind == "literal":
        return operand.value
    if operand.kind == "dot":
        return dot
    if operand.kind == "ident":
        return _command([operand], dot, state, _NO_VALUE)
    if operand.kind == "variable":
        value = state.variable(str(operand.value))
    elif operand.kind == "pipe":
        value = _pipe_value(operand.value, dot, state)
    else:
        value = dot
        if (state.stop_at_response and operand.chain == ["Response"] and dot is state.root):
            raise _Stop
    for name in operand.chain:
        value = _field_of(value, name, "." + ".".join(operand.chain))
    return value


# -- the template ---------------------------------------------------------------------------

class GoTemplate:
    def __init__(self, source: str) -> None:
        parser = _Parser(source)
        self.nodes = parser.parse()
        names = {n.lower() for n in parser.names}
        self.uses_messages = "messages" in names
        if "messages" not in names and "response" not in names:
            # Ollama appends {{ .Response }} to a template that has neither
            self.nodes.append(Node("action", pipe=Pipe([[Operand("field", chain=["Response"])]])))

    def render(self, messages: list[dict[str, Any]], suffix: str = "",
               tools: list[Any] | None = None, think: bool | str | None = None) -> str:
        flags = {"Think": think is not None and think is not False,
                 "IsThinkSet": think is not None}
        system, collated = collate(messages)
        if suffix:
            prompt = next((m["content"] for m in reversed(collated) if m["role"] == "user"), "")
            return self._execute({"Prompt": prompt, "Suffix": suffix, "Response": "", **flags},
                                 stop_at_response=False)
        if self.uses_messages:
            root = {"System": system, "Messages": collated, "Response": "",
                    "Tools": JSONList(tool_value(t) for t in tools or []), **flags}
            return self._execute(root, stop_at_response=False)
        turns = _turns(collated)
        out = [self._execute({**turn, **flags}, stop_at_response=False) for turn in turns[:-1]]
        out.append(self._execute({**turns[-1], **flags}, stop_at_response=True))
        return "".join(out)

    def _execute(self, root: dict[str, Any], stop_at_response: bool) -> str:
        state = _State(root, stop_at_response)
        try:
            _run(self.nodes, root, state)
        except _Stop:
            pass
        except (_Break, _Continue) as exc:
            raise TemplateError("{{ break }} or {{ continue }} outside a range") from exc
        except RecursionError as exc:
            raise TemplateError("template recursion too deep") from exc
        return "".join(state.out)


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collapse messages into (System, Prompt, Response) turns, as Ollama's legacy path does."""
    turns: list[dict[str, Any]] = []
    cur = {"System": "", "Prompt": "", "Response": ""}
    for m in messages:
        role, content = m["role"], m["content"]
        if (role == "system" and (cur["Prompt"] or cur["Response"])) or (
                role == "user" and cur["Response"]):
            turns.append(cur)
            cur = {"System": "", "Prompt": "", "Response": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role)
        if key:
            cur[key] = content
    turns.append(cur)
    return turns
