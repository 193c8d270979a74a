"""The audit log writes its lines in batches, in order, and never on the event loop's thread."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import IO

from registry.service.auth.audit import FLUSH_DELAY, AuditLog


class Recording:
    """The log's real file, noting the thread of every write."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.threads: list[threading.Thread] = []

    def write(self, text: str) -> int:
        self.threads.append(threading.current_thread())
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def close(self) -> None:
        self.stream.close()


def test_lines_are_written_later_off_the_loop_in_order(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    recording = Recording(log._stream)
    log._stream = recording  # type: ignore[assignment]

    async def serve() -> threading.Thread:
        for n in range(50):
            log.write(subject="alice", status=201, n=n)
        assert path.read_text() == ""  # nothing written while the requests ran
        await asyncio.sleep(FLUSH_DELAY * 4)
        log.write(subject="bob", status=401, n=50)
        await asyncio.sleep(FLUSH_DELAY * 4)
        return threading.current_thread()

    loop_thread = asyncio.run(serve())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["n"] for r in records] == list(range(51))
    assert records[0]["subject"] == "alice" and records[-1]["status"] == 401
    assert len(recording.threads) == 2  # two batches, not 51 writes
    assert all(t is not loop_thread for t in recording.threads)
    log.close()


def test_close_writes_what_is_pending(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))

    async def serve() -> None:
        log.write(subject="alice", status=202)

    asyncio.run(serve())  # the loop ends before the delayed write comes round
    log.close()
    assert json.loads(path.read_text())["status"] == 202
