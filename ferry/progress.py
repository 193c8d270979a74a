"""Renders the model server's NDJSON progress (pull, push, create) as rich progress bars."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def show_progress(events: Iterable[dict[str, Any]], console: Console | None = None) -> dict:
    """Draw one bar per digest plus a total, a line per plain status; return the last event."""
    console = console or Console(stderr=True)
    last: dict[str, Any] = {}
    bars: dict[str, TaskID] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        total_task: TaskID | None = None
        for event in events:
            last = event
            digest, total = event.get("digest"), event.get("total")
            if digest and total:
                if digest not in bars:
                    bars[digest] = bar.add_task(event.get("status", digest), total=total)
                bar.update(bars[digest], completed=event.get("completed", 0),
                           description=event.get("status", digest))
                if len(bars) > 1:
                    if total_task is None:
                        total_task = bar.add_task("total", total=0)
                    tasks = [bar.tasks[t] for t in bars.values()]
                    bar.update(total_task, total=sum(t.total or 0 for t in tasks),
                               completed=sum(t.completed for t in tasks))
            elif "status" in event:
                bar.console.print(event["status"])
    return last
