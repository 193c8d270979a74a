"""Receive buffers for blob bodies, reused once every holder of a piece is done with it.

Why: the lean body path (plain_socket.py) fills one 1 MiB buffer per piece. A fresh `bytearray`
per piece is zeroed first, and on a large body its pages are faulted in again and again (in a
VM, each first touch may also cost the host a fault): on a 2-core machine that was the hottest
line of the pull-through cache. Reusing a few dozen buffers makes those costs vanish.

Ownership is the interpreter's own reference count, not a release call: a piece is a
memoryview of a pooled bytearray, and every holder of that piece (a queue, the hasher, a file
writer on its thread, a subscriber's replay, the event loop's send buffer) holds the bytearray
through its view, slices included. The pool hands a buffer out again only when its own list is
the last holder, so no consumer can see its bytes overwritten, and none has to remember to give
a buffer back (one that forgets, or keeps a piece for long, only makes the pool allocate anew).
"""

from __future__ import annotations

import sys
import threading

_probe = [bytearray(1)]
_UNHELD = sys.getrefcount(_probe[0])  # the pool's list slot + getrefcount's own argument
del _probe


class BufferPool:
    """Up to `limit` buffers of `size` bytes; `take()` returns one that nobody holds."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        self._buffers: list[bytearray] = []
        self._next = 0  # where the last search stopped: the oldest handed-out buffer is next
        self._lock = threading.Lock()  # several event loops (threads) may read bodies at once
        self.active = 0  # bodies being read now; the pool is emptied when it stays at 0

    def take(self) -> bytearray:
        with self._lock:
            buffers = self._buffers
            count = len(buffers)
            for step in range(count):
                index = (self._next + step) % count
                if sys.getrefcount(buffers[index]) == _UNHELD:
                    self._next = index + 1
                    return buffers[index]
            buffer = bytearray(self.size)
            if count < self.limit:
                buffers.append(buffer)
            return buffer

    def __len__(self) -> int:
        return len(self._buffers)

    def enter(self) -> None:
        """A body starts being read."""
        with self._lock:
            self.active += 1

    def leave(self) -> bool:
        """A body ended; True when none is read now and the pool holds buffers."""
        with self._lock:
            self.active -= 1
            return self.active == 0 and bool(self._buffers)

    def clear_if_idle(self) -> None:
        """Give the memory back when no body is being read (buffers still held by a consumer
        are freed when it lets go)."""
        with self._lock:
            if self.active == 0:
                self._buffers.clear()
                self._next = 0
