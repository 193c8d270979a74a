"""The runner process's C heap: large freed blocks go back to the OS (runner/load.py
`return_large_frees`), checked in a fresh interpreter since the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys
import psutil
from runner.load import return_large_frees
if sys.argv[1] == "set":
    return_large_frees()
big = bytearray(24 << 20)  # freed: glibc would raise its mmap threshold to its size
del big
before = psutil.Process().memory_info().rss
blocks = [bytearray(4 << 20) for _ in range(6)]  # 24 MiB in blocks below that size
del blocks
print(psutil.Process().memory_info().rss - before)
"""


def _kept_after_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def test_freed_large_blocks_leave_nothing_resident():
    """A GGUF load frees a tensor's raw bytes (26 MB for a 32k-vocabulary Q8_0 head); by
    default glibc then serves blocks up to that size from its heap and keeps them resident
    once freed, under the weights and every request. With the runner's setting it does not."""
    assert _kept_after_free("default") >= 16 << 20  # the scenario: glibc keeps them
    assert _kept_after_free("set") <= 4 << 20
