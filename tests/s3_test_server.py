"""moto's S3 server (server mode, its own process) with one fix: a conditional PUT (If-Match /
If-None-Match) checks and writes atomically, as S3 documents. moto checks the precondition and
then writes, and its server is threaded, so two racing compare-and-swaps could both succeed;
real S3 lets exactly one win, and ferry's tag moves rely on that.

    python -m tests.s3_test_server -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_CONDITIONAL = threading.Lock()
_put_object = S3Response.put_object


@functools.wraps(_put_object)
def _atomic_put_object(self: S3Response) -> Any:
    if "If-Match" in self.headers or "If-None-Match" in self.headers:
        with _CONDITIONAL:
            return _put_object(self)
    return _put_object(self)


S3Response.put_object = _atomic_put_object  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
