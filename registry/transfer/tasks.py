"""Concurrency helpers: run coroutines together (first error raised plainly), long jobs on a
thread of their own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def run_all(coroutines: Iterable[Coroutine[Any, Any, Any]]) -> None:
    """Like a TaskGroup, but raise the first error plainly instead of an ExceptionGroup,
    so callers and the API edge see the domain error (a refused hop, a digest mismatch)."""
    try:
        async with asyncio.TaskGroup() as group:
            for coroutine in coroutines:
                group.create_task(coroutine)
    except BaseExceptionGroup as group_error:
        raise _first_leaf(group_error) from None


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def in_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run a long blocking `fn` on a thread of its own, not the default executor.

    A hasher waits for bytes the download writes through `asyncio.to_thread`; parking it in
    the shared executor could fill every worker with waiters and starve the writers.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task, not lost in the thread
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future
