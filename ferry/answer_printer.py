"""How `ferry run` writes a streamed answer: reasoning apart, words wrapped at the terminal.

Reasoning goes between Ollama's "Thinking..." and "...done thinking." lines (unless hidden),
then the answer; with word wrap on (the default on a terminal), both wrap at its width.
"""

from __future__ import annotations

import shutil
import sys

from ferry.wordwrap import WordWrapper


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class AnswerPrinter:
    def __init__(self, show_thinking: bool, wrap: bool) -> None:
        self.show_thinking = show_thinking
        self.answer = ""
        self.reasoning = ""
        width = shutil.get_terminal_size().columns
        self.wrapper = WordWrapper(width, _write) if wrap else None

    def _out(self, text: str) -> None:
        if self.wrapper is not None:
            self.wrapper.feed(text)
        else:
            _write(text)

    def thinking(self, text: str) -> None:
        if not text:
            return
        if self.show_thinking:
            self._out(("Thinking...\n" if not self.reasoning else "") + text)
        self.reasoning += text

    def content(self, text: str) -> None:
        if not text:
            return
        if self.reasoning and not self.answer and self.show_thinking:
            self._out("\n...done thinking.\n\n")
        self._out(text)
        self.answer += text

    def end(self) -> None:
        """Finish the answer's line, so that whatever follows starts on its own."""
        if self.wrapper is not None:
            self.wrapper.flush()
        _write("\n")
