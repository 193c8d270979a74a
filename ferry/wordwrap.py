"""Word wrapping for streamed text: words never split across terminal lines.

Text arrives in arbitrary pieces, so the word being written is held until a space or newline
ends it; a word that would pass the width starts a new line instead (the space before it is
dropped). Newlines in the text reset the column.
"""

from __future__ import annotations

from collections.abc import Callable


class WordWrapper:
    def __init__(self, width: int, write: Callable[[str], None]) -> None:
        self.width = max(width, 10)
        self.write = write
        self.column = 0
        self.word = ""
        self.spaces = ""

    def feed(self, text: str) -> None:
        for char in text:
            if char == "\n":
                self._word()
                self.spaces = ""
                self.write("\n")
                self.column = 0
            elif char == " ":
                self._word()
                self.spaces += " "
            else:
                self.word += char

    def flush(self) -> None:
        self._word()
        self.spaces = ""

    def _word(self) -> None:
        if not self.word:
            return
        if self.column and self.column + len(self.spaces) + len(self.word) > self.width:
            self.write("\n")
            self.column, self.spaces = 0, ""
        self.write(self.spaces + self.word)
        self.column += len(self.spaces) + len(self.word)
        self.word, self.spaces = "", ""
