"""Go-style durations, read the way Ollama reads `keep_alive` and its duration settings.

One parser for the environment (`FERRY_KEEP_ALIVE`, `FERRY_LOAD_TIMEOUT`, ...) and for a
request's `keep_alive`, so a value one accepts the other accepts too.
"""

from __future__ import annotations

import math
import re

_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                 "h": 3600.0}


class InvalidDuration(ValueError):
    """Text that is neither a Go duration nor a number of seconds."""

    def __init__(self, text: str) -> None:
        super().__init__(f"invalid duration {text!r}: expected a Go duration like 30s, 1h30m "
                         f"or 500ms, or a number of seconds")
        self.text = text


def parse_duration(text: str) -> float:
    """Seconds from a Go duration (`30s`, `1h30m`, `500ms`, `-1s`) or a bare number of
    seconds (`300`, `0`, `-1`, `1.5`). Callers decide what a negative value means (Ollama:
    keep the model loaded forever)."""
    stripped = text.strip()
    try:
        seconds = float(stripped)
    except ValueError:
        seconds = _go_duration(stripped, text)
    if not math.isfinite(seconds):
        raise InvalidDuration(text)
    return seconds


def _go_duration(body: str, original: str) -> float:
    """`[+-]` then one or more `<number><unit>` parts, as Go's time.ParseDuration reads."""
    sign = -1.0 if body.startswith("-") else 1.0
    if body[:1] in "+-":
        body = body[1:]
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidDuration(original)
    return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
