"""Modelfile parsing (Ollama's syntax) and the create request it becomes.

    # comment
    FROM ./checkpoint            (a dir, a .gguf file, or an existing model name)
    DRAFT ./draft-checkpoint
    PARAMETER temperature 0.7
    PARAMETER stop "<|im_end|>"
    TEMPLATE \"\"\"{{ .Prompt }}\"\"\"
    SYSTEM You are terse.
    LICENSE \"\"\"MIT ...\"\"\"
    MESSAGE user Hello
    REQUIRES 0.19.0

Commands are case-insensitive; a value is the rest of the line, a "quoted string" or a
\"\"\"triple-quoted\"\"\" block that may span lines. Pure: no file access, no network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workflows.create.errors import CreateError

COMMANDS = frozenset({"from", "draft", "parameter", "template", "system", "license", "message",
                      "requires", "adapter"})
LIST_PARAMETERS = frozenset({"stop"})
INT_PARAMETERS = frozenset({"num_ctx", "num_predict", "top_k", "seed", "repeat_last_n",
                            "num_keep", "num_batch", "num_gpu", "num_thread", "mirostat"})
BOOL_PARAMETERS = frozenset({"numa", "use_mmap", "penalize_newline"})


@dataclass
class Modelfile:
    from_: str = ""
    draft: str = ""
    parameters: list[tuple[str, str]] = field(default_factory=list)
    template: str | None = None
    system: str | None = None
    licenses: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    requires: str | None = None

    def typed_parameters(self) -> dict[str, Any]:
        """PARAMETER lines as the JSON object the params layer holds (stop is a list)."""
        out: dict[str, Any] = {}
        for key, raw in self.parameters:
            if key in LIST_PARAMETERS:
                out.setdefault(key, []).append(raw)
            else:
                out[key] = _typed(key, raw)
        return out


def _typed(key: str, raw: str) -> Any:
    try:
        if key in INT_PARAMETERS:
            return int(raw)
        if key in BOOL_PARAMETERS:
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        return float(raw)
    except ValueError:
        if key in INT_PARAMETERS or key in BOOL_PARAMETERS:
            raise CreateError(f"PARAMETER {key}: invalid value {raw!r}") from None
        return raw


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text.replace("\r\n", "\n"), 0

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def skip_blank(self) -> None:
        while not self.at_end():
            if self.text[self.pos] in " \t\n":
                self.pos += 1
            elif self.text[self.pos] == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return

    def word(self) -> str:
        while not self.at_end() and self.text[self.pos] in " \t":
            self.pos += 1
        start = self.pos
        while not self.at_end() and self.text[self.pos] not in " \t\n":
            self.pos += 1
        return self.text[start:self.pos]

    def value(self) -> str:
        while not self.at_end() and self.text[self.pos] in " \t":
            self.pos += 1
        if self.text.startswith('"""', self.pos):
            return self._until('"""', self.pos + 3)
        if self.text.startswith('"', self.pos):
            return self._until('"', self.pos + 1).replace('\\"', '"')
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        line, self.pos = self.text[self.pos:end], end
        return line.strip()

    def _until(self, quote: str, start: int) -> str:
        end = start
        while True:
            end = self.text.find(quote, end)
            if end < 0:
                raise CreateError(f"Modelfile: unterminated {quote} string")
            if quote == '"' and self.text[end - 1] == "\\":
                end += 1
                continue
            self.pos = end + len(quote)
            return self.text[start:end]


def parse_modelfile(text: str) -> Modelfile:
    """Parse Modelfile text; unknown commands and missing FROM are CreateErrors."""
    scanner, model = _Scanner(text), Modelfile()
    while True:
        scanner.skip_blank()
        if scanner.at_end():
            break
        command = scanner.word().lower()
        if command not in COMMANDS:
            raise CreateError(f"Modelfile: unknown command {command.upper()!r}")
        _apply(model, command, scanner)
    if not model.from_:
        raise CreateError("Modelfile: no FROM line")
    return model


def _apply(model: Modelfile, command: str, scanner: _Scanner) -> None:
    if command == "parameter":
        key = scanner.word().lower()
        model.parameters.append((key, scanner.value()))
    elif command == "message":
        role = scanner.word().lower()
        if role not in ("system", "user", "assistant", "tool"):
            raise CreateError(f"Modelfile: MESSAGE role {role!r} is not system, user, "
                              "assistant or tool")
        model.messages.append({"role": role, "content": scanner.value()})
    elif command == "license":
        model.licenses.append(scanner.value())
    elif command == "adapter":
        raise CreateError("Modelfile: ADAPTER is not supported by ferry")
    else:
        attr = {"from": "from_", "draft": "draft"}.get(command, command)
        setattr(model, attr, scanner.value())
