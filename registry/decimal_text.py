"""Numbers from request text (headers, query parameters) without the two traps of `int()`:
`str.isdigit` accepts non-ASCII digits (`²`) that `int` then refuses, and `int` of a 5,000-digit
string raises (Python caps conversions at 4,300 digits) after spending time on it.
"""

from __future__ import annotations

import re

SATURATED = 10**18  # larger than any size, offset or count a request can mean
_DECIMAL = re.compile(r"[0-9]+")


def saturating_decimal(text: str | None) -> int | None:
    """A non-negative ASCII decimal, capped at SATURATED; None when `text` is not one."""
    if text is None or _DECIMAL.fullmatch(text) is None:
        return None
    digits = text.lstrip("0")
    return SATURATED if len(digits) > 18 else int(digits or "0")
