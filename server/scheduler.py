"""The model server's side of runners: spawn, health, fit check, evict, close (reference 3.1).

One runner process per loaded model, keyed by the model's full name. Every change to the table of
runners happens under one asyncio lock (`self._cond`), so a load never races an eviction or
`close()`: a load starts and records its process while holding the lock, and once `close()` has
run no load starts. Waiting for a runner to become ready happens outside the lock, so one slow
load does not block requests to models that are already loaded.

Memory: a model needs its tensor bytes plus a fixed per-process overhead. It must fit in the
memory limit (default: the machine's total memory) minus what the loaded runners were charged;
while other runners are loaded it must also fit in the system's available memory, since their real
use may exceed the estimate. A miss evicts the least recently used idle runner and checks again;
with only busy runners left it waits for one to go idle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import psutil

from registry import media_types as mt
from registry.errors import FerryError
from registry.manifests import Manifest
from registry.names import Name
from registry.store import Store
from server.runner_process import RunnerError, RunnerProcess, format_bytes

log = logging.getLogger("ferry.scheduler")

DEFAULT_OVERHEAD = 512 * 1024 * 1024
STOP_GRACE_SECONDS = 5.0

Command = Callable[[str, int], list[str]]
# The directory holding our packages: a runner imports ferry from here, not from its cwd.
SOURCE_ROOT = str(Path(__file__).resolve().parents[1])


class InsufficientMemory(FerryError):
    """A model does not fit even with every other runner stopped; sizes in bytes."""

    def __init__(self, needed: int, available: int, overhead: int) -> None:
        super().__init__(f"model requires {format_bytes(needed)} but only "
                         f"{format_bytes(max(available, 0))} are available "
                         f"(after {format_bytes(overhead)} overhead)")
        self.needed = needed
        self.available = available
        self.overhead = overhead


class SchedulerClosed(FerryError):
    """A load was asked for after `Scheduler.close()` began."""

    def __init__(self) -> None:
        super().__init__("the model server is shutting down")


class SchedulerSettings(Protocol):
    """What the scheduler reads of ferry's Settings (ferry/config.py satisfies it)."""

    @property
    def keep_alive(self) -> float: ...
    @property
    def load_timeout(self) -> float: ...
    @property
    def max_loaded_models(self) -> int: ...
    def child_env(self) -> dict[str, str]: ...


def runner_command(name: str, port: int) -> list[str]:
    """The command that starts a runner: this interpreter running the `ferry` CLI.

    `-P` keeps the server's working directory off sys.path, so a stray `registry/` folder there
    cannot shadow ours; `runner_env` puts our own directory on PYTHONPATH instead.
    """
    return [sys.executable, "-P", "-m", "ferry.cli", "runner", "--model", name,
            "--port", str(port)]


def runner_env(settings: SchedulerSettings) -> dict[str, str]:
    env = settings.child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SOURCE_ROOT, env.get("PYTHONPATH")) if p)
    return env


def _key(name: str) -> str:
    """Runner table key: names compare case-insensitively, as in Ollama."""
    return name.lower()


class ResolvedModel(Protocol):
    """A model whose manifest the caller already read (server.chat_request.ModelDefaults):
    the runner is then the one for exactly that manifest, with no second read of the store."""

    name: Name
    digest: str
    manifest: Manifest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model_memory(manifest: Manifest) -> int:
    """Bytes of weights a runner will hold: the tensor layers (or a GGUF model layer)."""
    tensors = [d.size for d in manifest.layers if d.media_type == mt.TENSOR]
    if tensors:
        return sum(tensors)
    return sum(d.size for d in manifest.layers if d.media_type == mt.MODEL)


class Lease:
    """One request's hold on a ready runner; `release()` must be called exactly once."""

    def __init__(self, scheduler: Scheduler, runner: RunnerProcess, keep_alive: float,
                 load_duration: float) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.keep_alive = keep_alive
        self.load_duration = load_duration
        self._released = False

    def complete(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /v1/completions to the runner; yields its NDJSON messages."""
        return self.runner.complete(body)

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/embed to the runner; its JSON answer."""
        return await self.runner.embed(body)

    def release(self) -> None:
        """Synchronous, so it is safe in a cancelled request's `finally`."""
        if not self._released:
            self._released = True
            self.scheduler._release(self.runner, self.keep_alive)


class Scheduler:
    """Owns every runner process of one model server."""

    def __init__(self, settings: SchedulerSettings, store: Store, *,
                 command: Command = runner_command, memory_limit: int | None = None,
                 overhead: int = DEFAULT_OVERHEAD, poll_interval: float = 0.1,
                 stop_grace: float = STOP_GRACE_SECONDS) -> None:
        self.settings = settings
        self.store = store
        self.command = command
        self.memory_limit = memory_limit or psutil.virtual_memory().total
        self.overhead = overhead
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        self._runners: dict[str, RunnerProcess] = {}
        self._cond = asyncio.Condition()
        self._closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- public API ----------------------------------------------------------------------------

    async def acquire(self, model: Name | ResolvedModel, keep_alive: float | None = None) -> Lease:
        """A ready runner for `model`, loading it (and evicting others) when needed. A bare name
        is looked up in the store; a resolved model is run as the caller read it."""
        keep = self.settings.keep_alive if keep_alive is None else keep_alive
        if isinstance(model, Name):
            entry = await asyncio.to_thread(self.store.get_model, model)
            name, manifest, digest = model, entry.manifest(), entry.digest.hex
        else:
            name, manifest, digest = model.name, model.manifest, model.digest
        started = time.monotonic()
        runner = await self._reserve(str(name), manifest, digest)
        try:
            await asyncio.shield(runner.ready)
        except BaseException:
            self._release(runner, keep)
            raise
        return Lease(self, runner, keep, time.monotonic() - started)

    def running(self) -> list[RunnerProcess]:
        """Runners that finished loading, most recently used first."""
        ready = [r for r in self._runners.values() if r.is_ready]
        return sorted(ready, key=lambda r: r.last_used, reverse=True)

    def get(self, name: Name) -> RunnerProcess | None:
        return self._runners.get(_key(str(name)))

    async def unload(self, name: Name) -> bool:
        """Stop `name`'s runner now if idle, else as soon as its requests finish."""
        async with self._cond:
            runner = self._runners.get(_key(str(name)))
            if runner is None:
                return False
            runner.stop_when_idle = True
            if runner.refs == 0:
                await self._stop(runner)
            return True

    async def close(self) -> None:
        """Kill every runner and wait until each is reaped; later loads are refused."""
        async with self._cond:
            self._closed = True
            runners = list(self._runners.values())
            await asyncio.gather(*(self._stop(r) for r in runners))
            self._cond.notify_all()
        # Loading tasks end within a poll interval once their process is gone.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.stop_grace)

    # -- reservation ---------------------------------------------------------------------------

    async def _reserve(self, key: str, manifest: Manifest, digest: str) -> RunnerProcess:
        """Under the lock: reuse a live runner, or make room and start one. Takes one ref."""
        size = model_memory(manifest) + self.overhead
        async with self._cond:
            while True:
                if self._closed:
                    raise SchedulerClosed()
                runner = self._runners.get(_key(key))
                if runner is not None and (runner.broken or not runner.alive or (
                        runner.digest != digest and runner.refs == 0)):
                    await self._stop(runner)
                    continue
                if runner is not None:
                    runner.take()
                    return runner
                if await self._make_room(size):
                    return self._start(key, digest, size)

    async def _make_room(self, size: int) -> bool:
        """True when `size` fits now; otherwise evict one idle runner or wait, and say False."""
        too_many = len(self._runners) >= self.settings.max_loaded_models
        available = self._available()
        if not too_many and size <= available:
            return True
        victim = self._lru_idle()
        if victim is not None:
            log.info("evicting %s to make room", victim.name)
            await self._stop(victim)
            return False
        if not self._runners:
            raise InsufficientMemory(size, available, self.overhead)
        await self._cond.wait()
        return False

    def _available(self) -> int:
        charged = sum(r.size for r in self._runners.values())
        available = self.memory_limit - charged
        if self._runners:
            available = min(available, psutil.virtual_memory().available)
        return available

    def _lru_idle(self) -> RunnerProcess | None:
        idle = [r for r in self._runners.values() if r.refs == 0 and r.is_ready]
        return min(idle, key=lambda r: r.last_used, default=None)

    def _start(self, key: str, digest: str, size: int) -> RunnerProcess:
        """Spawn and record a runner (caller holds the lock); a task polls it until ready."""
        port = free_port()
        argv = self.command(key, port)
        env = runner_env(self.settings)
        log.info("starting runner for %s on port %d", key, port)
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, env=env)
        except OSError as exc:
            raise RunnerError(f"could not start the runner for {key}: "
                              f"{exc.strerror or type(exc).__name__}") from exc
        runner = RunnerProcess(key, digest, port, process, size)
        runner.take()
        self._runners[_key(key)] = runner
        runner.ready = self._spawn_task(self._wait_ready(runner))
        return runner

    async def _wait_ready(self, runner: RunnerProcess) -> None:
        """Poll the runner's status until ready; on failure drop it and raise why."""
        try:
            await runner.wait_ready(self.settings.load_timeout, self.poll_interval)
        except BaseException:
            async with self._cond:
                if self._runners.get(_key(runner.name)) is runner:
                    await self._stop(runner)
            raise
        async with self._cond:
            # Charge what the runner really holds when that exceeds the estimate.
            rss = (runner.status.get("memory") or {}).get("rss")
            if isinstance(rss, int) and rss > runner.size:
                runner.size = rss
            self._cond.notify_all()  # a load waiting for an idle runner may evict this one now

    # -- release, expiry, stop -----------------------------------------------------------------

    def _release(self, runner: RunnerProcess, keep_alive: float) -> None:
        runner.refs -= 1
        runner.last_used = time.monotonic()
        runner.keep_alive = keep_alive
        if runner.refs == 0:
            self._spawn_task(self._after_idle(runner))

    async def _after_idle(self, runner: RunnerProcess) -> None:
        """A runner went idle: stop it if broken or keep_alive is 0, else arm its timer."""
        async with self._cond:
            if self._runners.get(_key(runner.name)) is runner and runner.refs == 0:
                if (runner.broken or not runner.alive or runner.stop_when_idle
                        or runner.keep_alive == 0):
                    await self._stop(runner)
                elif runner.keep_alive > 0:
                    runner.arm_expiry(self._expire)
            self._cond.notify_all()

    def _expire(self, runner: RunnerProcess) -> None:
        async def expire() -> None:
            async with self._cond:
                if (self._runners.get(_key(runner.name)) is runner and runner.refs == 0
                        and runner.expired()):
                    log.info("keep_alive expired for %s", runner.name)
                    await self._stop(runner)
                    self._cond.notify_all()
        self._spawn_task(expire())

    async def _stop(self, runner: RunnerProcess) -> None:
        """Kill and reap `runner`, then forget it (caller holds the lock)."""
        runner.cancel_expiry()
        await asyncio.to_thread(runner.stop, self.stop_grace)
        await runner.aclose()
        if self._runners.get(_key(runner.name)) is runner:
            del self._runners[_key(runner.name)]
        self._cond.notify_all()

    def _spawn_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("runner task failed: %s", task.exception())


__all__ = ["InsufficientMemory", "Lease", "RunnerError", "Scheduler", "SchedulerClosed"]
