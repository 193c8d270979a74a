"""Values read back from evaluated MLX arrays, with the types the decode loops use.

mlx types `array.item()` as int | float | complex and `array.tolist()` as a nested union; these
check what a token or flag array really holds, so a wrong dtype fails here, by name, instead of
as a confusing error further on.
"""

from __future__ import annotations

import mlx.core as mx


def token_id(array: mx.array) -> int:
    """The token id in a scalar integer array."""
    value = array.item()
    if not isinstance(value, int):
        raise TypeError(f"expected an integer token id, got {value!r}")
    return value


def token_ids(array: mx.array) -> list[int]:
    """The token ids in a 1-D integer array."""
    ids: list[int] = []
    for value in _values(array):
        if not isinstance(value, int):
            raise TypeError(f"expected integer token ids, got {value!r}")
        ids.append(value)
    return ids


def number(array: mx.array) -> float:
    """The real number in a scalar array (a logprob)."""
    value = array.item()
    if isinstance(value, complex):
        raise TypeError(f"expected a real number, got {value!r}")
    return float(value)


def numbers(array: mx.array) -> list[float]:
    """The real numbers in a 1-D array."""
    out: list[float] = []
    for value in _values(array):
        if not isinstance(value, int | float):
            raise TypeError(f"expected real numbers, got {value!r}")
        out.append(float(value))
    return out


def flags(array: mx.array) -> list[bool]:
    """The values of a 1-D boolean array."""
    values: list[bool] = []
    for value in _values(array):
        if not isinstance(value, bool):
            raise TypeError(f"expected booleans, got {value!r}")
        values.append(value)
    return values


def _values(array: mx.array) -> list[object]:
    values = array.tolist()
    if not isinstance(values, list):
        raise TypeError(f"expected a 1-D array, got {values!r}")
    return list(values)
