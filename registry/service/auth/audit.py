"""The audit log: one JSON line per write or denial, to a file or stderr.

Fields: time, subject, address, method, action, repository, reference, digest, status. Never a
header, a credential or a token: the record is built from named fields only.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any


class AuditLog:
    def __init__(self, target: str) -> None:
        """`target`: a file path (appended to), or "-" for stderr."""
        self._lock = threading.Lock()
        self._stream: IO[str]
        if target == "-":
            self._stream, self._owned = sys.stderr, False
        else:
            path = Path(target).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            self._stream, self._owned = path.open("a", encoding="utf-8", buffering=1), True

    def write(self, **fields: Any) -> None:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._owned:
            self._stream.close()
