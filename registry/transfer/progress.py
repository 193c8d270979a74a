"""Ollama's progress messages for pull and push (reference 4.1), built with its omitempty rules.

The transfer client reports them through a callback; the model server streams them as NDJSON
(`server/api_stream.py`), the CLI draws them as bars.
"""

from __future__ import annotations

from typing import Any


def progress(status: str, digest: str | None = None, total: int | None = None,
             completed: int | None = None) -> dict[str, Any]:
    """A progress message with Ollama's omitempty rules."""
    msg: dict[str, Any] = {"status": status}
    if digest:
        msg["digest"] = digest
    if total:
        msg["total"] = total
    if completed:
        msg["completed"] = completed
    return msg
