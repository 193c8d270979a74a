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

from dataclasses import dataclass
from enum import Enum

from server.tool_calls import ToolCall, parse_tool_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
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

    def __init__(self, think: ThinkMode, tool_names: set[str]) -> None:
        self.think = think
        self.names = tool_names
        self.state = "start" if think is not ThinkMode.OFF else "answer"
        self.buffer = ""
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
            opened = CALL_OPEN if self.state == "call" else ""
            content, calls = parse_tool_calls(opened + rest, self.names)
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
        if self.names and not self.answered:
            stripped = self.buffer.lstrip()
            if stripped.startswith(_UNTAGGED_STARTS) or stripped.startswith("[TOOL_CALLS]"):
                self.state = "untagged"
                return False
            if not stripped or "[TOOL_CALLS]".startswith(stripped) or \
                    "<|python_tag|>".startswith(stripped):
                return False
        start = self.buffer.find(CALL_OPEN) if self.names else -1
        cut = start if start >= 0 else len(self.buffer) - (
            _held(self.buffer, CALL_OPEN) if self.names else 0)
        text = self.buffer[:cut]
        if self.names:  # whitespace before a call is layout, not answer: hold it
            text = text.rstrip()
        if text:
            out.append(text)
            self.answered = True
        if start < 0:
            self.buffer = self.buffer[len(text):]
            return False
        self.buffer, self.state = self.buffer[start + len(CALL_OPEN):], "call"
        return True

    def _call(self, out: list[Piece]) -> bool:
        end = self.buffer.find(CALL_CLOSE)
        if end < 0:
            return False
        whole = CALL_OPEN + self.buffer[:end + len(CALL_CLOSE)]
        self.buffer, self.state = self.buffer[end + len(CALL_CLOSE):], "answer"
        content, calls = parse_tool_calls(whole, self.names)
        if calls:
            out.append(Calls(self._number(calls)))
        elif content:
            out.append(content)
        return True

    def _number(self, calls: list[ToolCall]) -> list[ToolCall]:
        numbered = [call.numbered(self.calls + i) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return numbered
