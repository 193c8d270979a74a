"""Scheduler: load, reuse, kill, evict, expire and close runner processes.

These tests inject failures with a stand-in runner (fake_runner.py, the runner protocol over the
standard library); the real runner is exercised end to end in test_chat_api.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from conftest import runner_processes
from runner_fakes import add_model, fake_command

from registry.names import Name
from server.api_errors import status_for
from server.scheduler import (
    InsufficientMemory,
    RunnerError,
    Scheduler,
    SchedulerClosed,
)

MiB = 1024 * 1024


async def generate(lease, num_predict: int | None = None) -> str:
    options = {} if num_predict is None else {"num_predict": num_predict}
    text = ""
    async for message in lease.complete({"prompt": "hi", "options": options}):
        text += message["content"]
    return text


def children() -> list[psutil.Process]:
    return runner_processes()


def gone(pid: int) -> bool:
    """Reaped: no such process any more (a zombie would still count as present)."""
    return not psutil.pid_exists(pid)


async def until(predicate, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.05)


@pytest.fixture
async def scheduler_factory(settings, store):
    made: list[Scheduler] = []

    def make(*extra: str, settings_=None, **kwargs) -> Scheduler:
        kwargs.setdefault("overhead", MiB)
        kwargs.setdefault("stop_grace", 2.0)
        sched = Scheduler(settings_ or settings, store, command=fake_command(*extra), **kwargs)
        made.append(sched)
        return sched

    yield make
    for sched in made:
        await sched.close()


async def test_loaded_runner_is_reused_and_reports_its_status(scheduler_factory, store):
    sched = scheduler_factory()
    name = add_model(store, "me/tiny")
    lease = await sched.acquire(name, keep_alive=60)
    assert await generate(lease) == "tok0 tok1 tok2 "
    lease.release()
    again = await sched.acquire(name, keep_alive=60)
    assert again.runner is lease.runner
    assert again.runner.status["compute"] == "float32"
    assert [r.name for r in sched.running()] == [str(name)]
    again.release()


async def test_runner_killed_mid_request_fails_it_and_next_request_reloads(
        scheduler_factory, store):
    sched = scheduler_factory("--token-delay", "0.3", "--tokens", "20")
    name = add_model(store, "me/tiny")
    lease = await sched.acquire(name, keep_alive=60)
    first_pid = lease.runner.process.pid
    stream = lease.complete({"prompt": "hi"})
    assert (await anext(stream))["content"] == "tok0 "
    os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(RunnerError, match="terminated"):
        async for _ in stream:
            pass
    lease.release()
    await until(lambda: gone(first_pid))
    lease = await sched.acquire(name, keep_alive=60)
    assert lease.runner.process.pid != first_pid
    assert await generate(lease, num_predict=2) == "tok0 tok1 "
    lease.release()


async def test_runner_dying_while_loading_reports_its_last_stderr_line(
        scheduler_factory, store):
    sched = scheduler_factory("--die-on-load", "ValueError: tensor blob is truncated",
                              "--load-seconds", "30")
    name = add_model(store, "me/broken")
    with pytest.raises(RunnerError, match="ValueError: tensor blob is truncated"):
        await sched.acquire(name)
    assert sched.get(name) is None
    assert children() == []


async def test_load_timeout_stops_the_runner(scheduler_factory, store, settings):
    sched = scheduler_factory("--load-seconds", "60",
                              settings_=settings.with_(load_timeout=0.5))
    name = add_model(store, "me/slow")
    with pytest.raises(RunnerError, match="timed out"):
        await sched.acquire(name)
    await until(lambda: children() == [])
    assert sched.get(name) is None


async def test_close_kills_every_runner_and_leaves_no_child(scheduler_factory, store):
    sched = scheduler_factory("--ignore-sigterm", stop_grace=0.5)
    loaded = add_model(store, "me/loaded")
    lease = await sched.acquire(loaded, keep_alive=-1)
    lease.release()
    pids = [lease.runner.process.pid]
    # A second model still loading when close() runs must not survive it either.
    slow_sched = scheduler_factory("--load-seconds", "60")
    loading = asyncio.create_task(slow_sched.acquire(add_model(store, "me/loading")))
    await until(lambda: len(children()) == 2)
    pids += [p.pid for p in children() if p.pid not in pids]
    await asyncio.gather(sched.close(), slow_sched.close())
    assert children() == []
    assert all(gone(pid) for pid in pids)
    with pytest.raises(RunnerError, match="stopped while loading"):
        await loading
    with pytest.raises(SchedulerClosed) as info:
        await sched.acquire(loaded)
    assert status_for(info.value) == 503


async def test_memory_miss_evicts_the_least_recently_used_idle_runner(scheduler_factory, store):
    # Each model is charged 40 MiB; 100 MiB holds two, not three.
    sched = scheduler_factory(overhead=40 * MiB, memory_limit=100 * MiB)
    a, b, c = (add_model(store, f"me/{x}") for x in "abc")
    pids = {}
    for name in (a, b):
        lease = await sched.acquire(name, keep_alive=-1)
        pids[name] = lease.runner.process.pid
        lease.release()
    touch = await sched.acquire(a, keep_alive=-1)  # a is now more recently used than b
    touch.release()
    await until(lambda: sched.get(a).refs == 0)
    lease = await sched.acquire(c, keep_alive=-1)
    lease.release()
    assert sorted(r.name for r in sched.running()) == sorted([str(a), str(c)])
    assert gone(pids[b]) and not gone(pids[a])


async def test_concurrent_loads_under_a_memory_limit_wait_for_the_busy_one_then_evict_it(
        scheduler_factory, store):
    sched = scheduler_factory(overhead=60 * MiB, memory_limit=100 * MiB)
    a, b = add_model(store, "me/a"), add_model(store, "me/b")
    held = await sched.acquire(a, keep_alive=-1)
    waiting = asyncio.create_task(sched.acquire(b, keep_alive=-1))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "b must wait: a is busy and both do not fit"
    assert len(children()) == 1
    held.release()
    lease = await waiting
    assert await generate(lease, num_predict=1) == "tok0 "
    lease.release()
    assert [r.name for r in sched.running()] == [str(b)]
    assert gone(held.runner.process.pid)


async def test_concurrent_requests_for_two_models_both_complete(scheduler_factory, store):
    sched = scheduler_factory(overhead=60 * MiB, memory_limit=100 * MiB)
    a, b = add_model(store, "me/a"), add_model(store, "me/b")

    async def one(name: Name) -> str:
        lease = await sched.acquire(name, keep_alive=-1)
        try:
            return await generate(lease, num_predict=2)
        finally:
            lease.release()

    assert await asyncio.gather(one(a), one(b), one(a)) == ["tok0 tok1 "] * 3
    assert len(sched.running()) == 1


async def test_a_model_larger_than_the_limit_is_refused(scheduler_factory, store):
    sched = scheduler_factory(overhead=60 * MiB, memory_limit=50 * MiB)
    with pytest.raises(InsufficientMemory, match=r"requires 60\.0 MiB but only 50\.0 MiB") as info:
        await sched.acquire(add_model(store, "me/big"))
    assert info.value.needed >= 60 * MiB and info.value.available == 50 * MiB
    assert status_for(info.value) == 500
    assert children() == []


async def test_max_loaded_models_evicts_the_idle_runner(scheduler_factory, store, settings):
    sched = scheduler_factory(settings_=settings.with_(max_loaded_models=1))
    a, b = add_model(store, "me/a"), add_model(store, "me/b")
    first = await sched.acquire(a, keep_alive=-1)
    first.release()
    second = await sched.acquire(b, keep_alive=-1)
    second.release()
    assert [r.name for r in sched.running()] == [str(b)]
    assert gone(first.runner.process.pid)


async def test_keep_alive_zero_unloads_when_the_request_ends(scheduler_factory, store):
    sched = scheduler_factory()
    lease = await sched.acquire(add_model(store, "me/tiny"), keep_alive=0)
    await generate(lease)
    lease.release()
    await until(lambda: sched.running() == [] and gone(lease.runner.process.pid))


async def test_keep_alive_expiry_unloads_and_negative_keeps_forever(scheduler_factory, store):
    sched = scheduler_factory()
    short, forever = add_model(store, "me/short"), add_model(store, "me/forever")
    lease = await sched.acquire(forever, keep_alive=-1)
    lease.release()
    assert lease.runner.until() is None
    lease = await sched.acquire(short, keep_alive=0.3)
    lease.release()
    await until(lambda: sched.get(short) is None)
    assert gone(lease.runner.process.pid)
    assert [r.name for r in sched.running()] == [str(forever)]


async def test_unload_stops_an_idle_runner(scheduler_factory, store):
    sched = scheduler_factory()
    name = add_model(store, "me/tiny")
    lease = await sched.acquire(name, keep_alive=-1)
    lease.release()
    await until(lambda: sched.get(name).refs == 0)
    assert await sched.unload(name) is True
    assert sched.get(name) is None and gone(lease.runner.process.pid)
    assert await sched.unload(name) is False


async def test_runner_client_errors_keep_their_status(scheduler_factory, store):
    sched = scheduler_factory()
    lease = await sched.acquire(add_model(store, "me/tiny"))
    with pytest.raises(RunnerError, match="num_ctx must be positive") as info:
        async for _ in lease.complete({"prompt": "x", "options": {"num_ctx": -1}}):
            pass
    assert info.value.runner_status == 400 and status_for(info.value) == 400
    lease.release()
    assert not lease.runner.broken
