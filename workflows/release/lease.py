"""Holding a release lease for the length of a run: acquire (waiting if asked), renew, release.

The stores make acquisition atomic (S3: a conditional write; OCI: a lock tag; GitHub: a
lease asset whose name must be unique). This module adds the time dimension: wait for a held
lease up to a deadline, renew ours in a background thread every third of its lifetime, and
remember a failed renewal so the job stops before it publishes anything more.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType

from workflows.release.retries import call_with_retries
from workflows.release.store import Lease, LeaseHeld, LeaseLost, ReleaseRef, ReleaseStore


def new_holder() -> str:
    """A name for this run that is unique and still says where it came from."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def acquire(store: ReleaseStore, ref: ReleaseRef, holder: str, ttl: float, wait: float,
            poll: float, sleep: Callable[[float], None], delays: Sequence[float] = (),
            on_wait: Callable[[LeaseHeld], None] | None = None) -> Lease:
    """Take the lease; while another run holds it, poll until `wait` seconds have passed,
    then raise the last LeaseHeld (wait=0 fails at once). Transient store errors are
    retried after `delays`, like every other remote call of the job."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return call_with_retries(lambda: store.acquire_lease(ref, holder, ttl), delays,
                                     sleep)
        except LeaseHeld as held:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            if on_wait is not None:
                on_wait(held)
            sleep(min(poll, remaining))


class LeaseKeeper:
    """Renews a lease in a daemon thread; `check()` raises LeaseLost once a renewal failed."""

    def __init__(self, lease: Lease, ttl: float) -> None:
        self.lease = lease
        self.ttl = ttl
        self._stop = threading.Event()
        self._lost: LeaseLost | None = None
        self._thread = threading.Thread(target=self._run, name="release-lease", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.lease.release()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.lease.renew(self.ttl)
            except LeaseLost as exc:
                self._lost = exc
                return
            except Exception as exc:  # a failed renewal is retried next period, until expiry
                if time.time() >= self.lease.expires_at:
                    self._lost = LeaseLost(f"could not renew the release lease: {exc}")
                    return

    def check(self) -> None:
        """Raise LeaseLost if the lease is gone or past its expiry."""
        if self._lost is not None:
            raise self._lost
        if time.time() >= self.lease.expires_at:
            raise LeaseLost("the release lease expired before the run finished")
