"""The one retry policy of the transfer client.

Transient: connection errors, timeouts (a read that sees no byte for the stall timeout is one),
a body that ended early, 429 and 5xx. Everything else (4xx, a refused hop, a digest mismatch,
cancellation) fails at once. Waits grow exponentially with full jitter, capped; a 429 or 503 with
`Retry-After` waits what the server asked (capped too). When the attempts run out the error names
the last cause.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TypeVar

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from registry.transfer.errors import RetriesExhausted, TransferError, TransientStatus

T = TypeVar("T")


class ShortRead(TransferError):
    """A body ended before the bytes it promised; what arrived is kept and the rest refetched."""


def is_transient(exc: BaseException) -> bool:
    if caused_by_tls(exc):
        return False  # an untrusted certificate or a non-TLS peer will not change on retry
    return isinstance(exc, httpx.TransportError | TransientStatus | ShortRead)


def caused_by_tls(exc: BaseException | None, marker: str = "") -> bool:
    """Whether a TLS failure (optionally one whose text holds `marker`) caused `exc`."""
    seen = 0
    while exc is not None and seen < 10:
        text = str(exc)
        if (isinstance(exc, ssl.SSLError) or "[SSL" in text) and marker in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    import time

    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class RetryPolicy:
    """Capped, jittered exponential backoff over classified errors."""

    attempts: int = 6
    initial: float = 0.5
    cap: float = 10.0
    retry_after_cap: float = 60.0
    sleep: Callable[[float], Awaitable[None]] | None = None  # tests record the waits

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, TransientStatus) and exc.retry_after is not None:
            return min(exc.retry_after, self.retry_after_cap)
        return wait_random_exponential(multiplier=self.initial, max=self.cap)(state)

    async def run(self, what: str, attempt: Callable[[int], Awaitable[T]]) -> T:
        """Call `attempt(n)` (n counts from 1) until it succeeds or fails for good."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=self._wait,
            retry=retry_if_exception(is_transient),
            sleep=self.sleep or asyncio.sleep,
        )
        try:
            async for state in retrying:
                with state:
                    return await attempt(state.retry_state.attempt_number)
        except RetryError as err:
            last = err.last_attempt.exception()
            assert last is not None
            raise RetriesExhausted(what, self.attempts, last) from last
        raise AssertionError("unreachable: tenacity ended without an outcome")
