"""A model's streamed answer split into reasoning, text and tool calls, piece by piece.

Text arrives in arbitrary pieces (a tag may be cut in two), so the parser holds back only what
could still be the start of a tag and emits everything else at once: reasoning inside a leading
`<think>…</think>` as `Thinking` (or drops it when the request said `think: false` and the
model reasoned anyway), the answer as text, and each `<tool_call>{…}</tool_call>` as a `Calls`
as soon as its closing tag arrives. Untagged call shapes (a bare JSON object, Mistral's
`[TOOL_CALLS]`, Llama's `<|python_tag|>`) are only recognisable whole, so an answer that starts
like one is held to the end and read by `parse_tool_calls`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from server.tool_calls import ToolCall, parse_nemotron_calls, parse_tool_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NEMOTRON_CALL_OPEN, NEMOTRON_CALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"  # Nemotron Nano v2
_UNTAGGED_STARTS = ("{", "[", "<|python_tag|>")


@dataclass(frozen=True)
class Thinking:
    """A piece of the model's reasoning."""

    text: str


@dataclass(frozen=True)
class Calls:
    """Tool calls found in the answer, each complete."""

    calls: list[ToolCall]


Piece = str | Thinking | Calls


class ThinkMode(Enum):
    OFF = "off"  # the model does not reason: all text is answer
    SHOW = "show"  # reasoning goes to `thinking`
    HIDE = "hide"  # think: false, but the model reasoned anyway: drop it


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class OutputParser:
    """Feed text pieces in order; `finish` once the answer ends."""

    # each opening tag of a call, and its closing tag
    CALL_TAGS: ClassVar[dict[str, str]] = {CALL_OPEN: CALL_CLOSE}
    UNTAGGED = True  # whether a call may come without tags (bare JSON, [TOOL_CALLS], ...)

    def __init__(self, think: ThinkMode, tool_names: Collection[str]) -> None:
        self.think = think
        self.names = tool_names
        self.state = "start" if think is not ThinkMode.OFF else "answer"
        self.buffer = ""
        self.opened = CALL_OPEN  # the opening tag of the call being read
        self.answered = False  # some answer text went out (an untagged call can no longer start)
        self.calls = 0
        self.trim = False

    def open_thinking(self) -> None:
        """The prompt ended inside `<think>` (the template opened it): reasoning comes first."""
        if self.think is not ThinkMode.OFF and self.state == "start":
            self.state = "thinking"

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while self.buffer:
            progressed = {"start": self._start, "thinking": self._thinking,
                          "answer": self._answer, "call": self._call,
                          "untagged": lambda _: False}[self.state](out)
            if not progressed:
                break
        return out

    def finish(self) -> list[Piece]:
        """What is still held: a partial tag is text, an untagged answer is read for calls."""
        out: list[Piece] = []
        rest, self.buffer = self.buffer, ""
        if self.state == "thinking" and self.think is ThinkMode.SHOW and rest:
            out.append(Thinking(rest))
        elif self.state in ("untagged", "call"):
            opened = self.opened if self.state == "call" else ""
            content, calls = self._parse(opened + rest)
            out += [content] if content else []
            out += [Calls(self._number(calls))] if calls else []
        elif self.state != "thinking" and rest and not (self.calls and not rest.strip()):
            out.append(rest)
        return out

    def _start(self, out: list[Piece]) -> bool:
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buffer, self.state = stripped[len(THINK_OPEN):], "thinking"
            return True
        if THINK_OPEN.startswith(stripped):
            return False  # whitespace or a partial tag: wait
        self.state = "answer"
        return True

    def _thinking(self, out: list[Piece]) -> bool:
        end = self.buffer.find(THINK_CLOSE)
        cut = end if end >= 0 else len(self.buffer) - _held(self.buffer, THINK_CLOSE)
        if cut and self.think is ThinkMode.SHOW:
            out.append(Thinking(self.buffer[:cut]))
        if end < 0:
            self.buffer = self.buffer[cut:]
            return False
        self.buffer, self.state = self.buffer[end + len(THINK_CLOSE):], "answer"
        self.trim = True
        return True

    def _answer(self, out: list[Piece]) -> bool:
        if self.trim:  # the blank lines after reasoning are layout
            self.buffer = self.buffer.lstrip()
            self.trim = not self.buffer
            if self.trim:
                return False
        if self.names and not self.answered and self.UNTAGGED:
            stripped = self.buffer.lstrip()
            if stripped.startswith(_UNTAGGED_STARTS) or stripped.startswith("[TOOL_CALLS]"):
                self.state = "untagged"
                return False
            if not stripped or "[TOOL_CALLS]".startswith(stripped) or \
                    "<|python_tag|>".startswith(stripped):
                return False
        start, self.opened = self._first_call() if self.names else (-1, self.opened)
        cut = start if start >= 0 else len(self.buffer) - (
            max(_held(self.buffer, tag) for tag in self.CALL_TAGS) if self.names else 0)
        text = self.buffer[:cut]
        if self.names:  # whitespace before a call is layout, not answer: hold it
            text = text.rstrip()
        if text:
            out.append(text)
            self.answered = True
        if start < 0:
            self.buffer = self.buffer[len(text):]
            return False
        self.buffer, self.state = self.buffer[start + len(self.opened):], "call"
        return True

    def _first_call(self) -> tuple[int, str]:
        """Where the first call tag in the buffer starts (-1: none), and which tag it is."""
        found = [(i, tag) for tag in self.CALL_TAGS if (i := self.buffer.find(tag)) >= 0]
        return min(found) if found else (-1, self.opened)

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_tool_calls(text, self.names)

    def _call(self, out: list[Piece]) -> bool:
        close = self.CALL_TAGS[self.opened]
        end = self.buffer.find(close)
        if end < 0:
            return False
        whole = self.opened + self.buffer[:end + len(close)]
        self.buffer, self.state = self.buffer[end + len(close):], "answer"
        content, calls = self._parse(whole)
        if calls:
            out.append(Calls(self._number(calls)))
        elif content:
            out.append(content)
        return True

    def _number(self, calls: list[ToolCall]) -> list[ToolCall]:
        numbered = [call.numbered(self.calls + i) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return numbered


class NemotronParser(OutputParser):
    """Nemotron's format: reasoning in `<think>`, which a call may end without `</think>` (as
    Ollama's nemotron3nano parser allows); calls as XML (`<tool_call><function=NAME>
    <parameter=KEY>VALUE</parameter></function></tool_call>`, Nemotron 3) or as a JSON list
    in `<TOOLCALL>…</TOOLCALL>` (Nemotron Nano v2). Nothing untagged is a call."""

    CALL_TAGS: ClassVar[dict[str, str]] = {CALL_OPEN: CALL_CLOSE,
                                           NEMOTRON_CALL_OPEN: NEMOTRON_CALL_CLOSE}
    UNTAGGED = False

    def _thinking(self, out: list[Piece]) -> bool:
        start, opened = self._first_call() if self.names else (-1, self.opened)
        close = self.buffer.find(THINK_CLOSE)
        if close >= 0 and (start < 0 or close < start):
            return super()._thinking(out)
        tags = [THINK_CLOSE, *(self.CALL_TAGS if self.names else ())]
        cut = start if start >= 0 else len(self.buffer) - max(_held(self.buffer, t) for t in tags)
        if cut and self.think is ThinkMode.SHOW:
            out.append(Thinking(self.buffer[:cut]))
        self.buffer = self.buffer[cut:]
        if start < 0:
            return False
        self.state, self.opened = "answer", opened  # a call ended the reasoning
        return True

    def _parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_nemotron_calls(text, self.names)


def parser_for(think: ThinkMode, tool_names: Collection[str], family: str = "",
               template: str = "") -> OutputParser:
    """The parser of a model's output format: Nemotron's for the nemotron families or a
    template that teaches its call markup, else the general one."""
    nemotron = family.startswith("nemotron") or any(
        mark in template for mark in (NEMOTRON_CALL_OPEN, "<function="))
    return (NemotronParser if nemotron else OutputParser)(think, tool_names)
