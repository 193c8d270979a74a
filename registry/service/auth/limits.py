"""Per-client limits: a token bucket of requests, and a cap on open upload sessions.

A client is its token's subject when it presents a valid token for a user, else its address.
State is per replica (in memory): N replicas behind a balancer allow up to N times the budget,
which the defaults in the README account for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

_MAX_CLIENTS = 100_000  # buckets kept; beyond this the idle ones are forgotten


@dataclass(frozen=True)
class LimitSettings:
    rate: float = 0.0  # requests per second per client; 0 turns the request limit off
    burst: int = 0  # bucket size; 0 means 10 seconds' worth of `rate`
    max_uploads: int = 0  # open upload sessions per client; 0 turns the cap off
    upload_ttl: float = 24 * 3600.0  # a session older than this no longer counts

    @property
    def active(self) -> bool:
        return self.rate > 0 or self.max_uploads > 0


@dataclass
class _Bucket:
    tokens: float
    updated: float


@dataclass
class RequestBuckets:
    rate: float
    burst: float
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, client: str, now: float | None = None) -> float:
        """0 when the request may go ahead, else the seconds until it could (Retry-After)."""
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= _MAX_CLIENTS:
                self._forget_full(now)
            bucket = self._buckets[client] = _Bucket(self.burst, now)
        tokens = bucket.tokens + (now - bucket.updated) * self.rate
        bucket.tokens = tokens if tokens < self.burst else self.burst  # min(), one call less
        bucket.updated = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled: forgetting them changes nothing. Under a flood of
        new clients none may have refilled: then the least recently used half goes, so the
        table stays bounded (and the rebuild happens once per _MAX_CLIENTS / 2 new clients)."""
        self._buckets = {k: b for k, b in self._buckets.items()
                         if b.tokens + (now - b.updated) * self.rate < self.burst}
        if len(self._buckets) >= _MAX_CLIENTS:
            recent = sorted(self._buckets.items(), key=lambda kv: kv[1].updated)
            self._buckets = dict(recent[len(recent) // 2:])


@dataclass
class UploadSlots:
    limit: int
    ttl: float
    _open: dict[str, dict[str, float]] = field(default_factory=dict)

    def full(self, client: str) -> bool:
        sessions = self._open.get(client)
        if not sessions or len(sessions) < self.limit:
            return False  # below the cap even counting stale ones: no need to look at them
        now = time.monotonic()
        for upload_id in [u for u, t in sessions.items() if now - t > self.ttl]:
            del sessions[upload_id]
        return len(sessions) >= self.limit

    def opened(self, client: str, upload_id: str) -> None:
        self._open.setdefault(client, {})[upload_id] = time.monotonic()

    def closed(self, client: str, upload_id: str) -> None:
        sessions = self._open.get(client)
        if sessions is not None:
            sessions.pop(upload_id, None)
            if not sessions:
                del self._open[client]


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
