"""Retry with fixed, configurable delays (15 s then 30 s by default): the release job's policy.

Only transient `StoreError`s are retried; anything else (a 4xx, a bug, a lost lease) fails at
once, and the last error is what the caller reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from workflows.release.store import StoreError

T = TypeVar("T")
OnRetry = Callable[[int, float, StoreError], None]  # (failed attempt number, delay, error)


def call_with_retries(fn: Callable[[], T], delays: Sequence[float],
                      sleep: Callable[[float], None], on_retry: OnRetry | None = None) -> T:
    """Call `fn`; after a transient failure wait `delays[i]` and try again, len(delays) times."""
    for attempt, delay in enumerate(delays, start=1):
        try:
            return fn()
        except StoreError as exc:
            if not exc.transient:
                raise
            if on_retry is not None:
                on_retry(attempt, delay, exc)
            sleep(delay)
    return fn()
