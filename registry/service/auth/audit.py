"""The audit log: one JSON line per write or denial, to a file or stderr.

Fields: time, subject, address, method, action, repository, reference, digest, status. Never a
header, a credential or a token: the record is built from named fields only. Lines are written
at most FLUSH_DELAY seconds after they are logged (and at shutdown), in one batch, not one by one:
a flush per line cost ~0.2 ms per write request, more than the rest of the auth layer together.
The batch is written on a worker thread, never on the event loop: while uploads fsync, an append
that grows the log file can wait on the filesystem journal, and on the loop that wait would stall
every request in flight. The request path only queues the record (its time and fields); the
JSON and the timestamp text are made in the batch, off the request's way.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

FLUSH_DELAY = 0.5


class AuditLog:
    def __init__(self, target: str) -> None:
        """`target`: a file path (appended to), or "-" for stderr."""
        self._lock = threading.Lock()  # guards _pending and _scheduled
        self._write_lock = threading.Lock()  # one batch at a time, in logging order
        self._pending: list[tuple[float, dict[str, Any]]] = []
        self._scheduled = False
        self._stream: IO[str]
        if target == "-":
            self._stream, self._owned = sys.stderr, False
        else:
            path = Path(target).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stream, self._owned = path.open("a", encoding="utf-8"), True

    def write(self, **fields: Any) -> None:
        with self._lock:
            self._pending.append((time.time(), fields))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool writing directly): write now
            self.flush()
            return
        loop.call_later(FLUSH_DELAY, self._flush_off_loop, loop)

    def _flush_off_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.run_in_executor(None, self.flush)
        except RuntimeError:  # the loop's executor is shutting down: write before it goes
            self.flush()

    def flush(self) -> None:
        """Write every pending line and flush the stream (blocking: not on the event loop)."""
        with self._write_lock:
            with self._lock:
                records, self._pending = self._pending, []
                self._scheduled = False
            if records and not self._stream.closed:
                self._stream.write("".join(_line(at, fields) for at, fields in records))
                self._stream.flush()

    def close(self) -> None:
        self.flush()
        if self._owned:
            self._stream.close()


def _line(at: float, fields: dict[str, Any]) -> str:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)), **fields}
    return json.dumps(record, separators=(",", ":"), default=str) + "\n"
