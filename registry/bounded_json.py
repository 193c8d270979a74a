"""JSON from untrusted bytes with explicit limits: nesting depth and the length of a number.

`json.loads` recurses once per nesting level (100,000 levels raise RecursionError deep in the
decoder) and converts any number, however long (5,000 digits raise ValueError, slowly). Both
servers parse request JSON here, so a hostile body gets a clear error, never a 500. Depth is
measured before parsing, over the bracket characters outside strings only.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

MAX_DEPTH = 64  # Ollama requests and OCI manifests nest 5-6 levels; tool schemas a few more
MAX_NUMBER_CHARS = 64  # a float64 or int64 needs at most ~25
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: linear, fast
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONLimitError(ValueError):
    """The document is (or may be) valid JSON, but beyond what ferry parses."""


def loads(raw: bytes | str) -> Any:
    """Parse JSON text; UnicodeDecodeError, json.JSONDecodeError or JSONLimitError on bad input."""
    text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else raw
    check_depth(text)
    try:
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError as exc:  # cannot happen after check_depth; kept as the last line
        raise JSONLimitError(f"JSON nested deeper than {MAX_DEPTH} levels") from exc


def check_depth(text: str, limit: int = MAX_DEPTH) -> None:
    brackets = _BRACKET.findall(_STRING.sub("", text))
    if len(brackets) <= limit:
        return
    deepest = max(itertools.accumulate(map(_STEP.__getitem__, brackets)))
    if deepest > limit:
        raise JSONLimitError(f"JSON nested deeper than {limit} levels")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise JSONLimitError(f"a JSON number longer than {MAX_NUMBER_CHARS} characters")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise JSONLimitError(f"a JSON number longer than {MAX_NUMBER_CHARS} characters")
    return float(text)


def _constant(name: str) -> float:
    """NaN and Infinity are not JSON; Python accepts them unless told otherwise."""
    raise JSONLimitError(f"{name} is not a JSON value")
