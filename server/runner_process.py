"""One runner process as the scheduler sees it: the child, its stderr tail, its HTTP protocol.

The scheduler (server/scheduler.py) owns the bookkeeping (refs, keep-alive, eviction); this
module knows how to talk to one runner (docs/runner-protocol.md) and how to stop it for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, Any

import httpx

from registry.errors import FerryError

log = logging.getLogger("ferry.runner")


# An absolute path of two or more directories (not a URL's path): a traceback line names the
# server's files, which a client must not see.
_SERVER_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s'\"/:,]+/){2,}([^\s'\"/:,]+)")


def without_paths(text: str) -> str:
    """`text` with absolute server paths cut to their last component."""
    return _SERVER_PATH.sub(r"\1", text)


class RunnerError(FerryError):
    """A runner failed to load, died, broke the protocol, or refused a request; the message says
    why. `runner_status` is the HTTP status the runner answered with, when it answered one."""

    def __init__(self, message: str, runner_status: int | None = None) -> None:
        super().__init__(message)
        self.runner_status = runner_status


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


class StderrTail:
    """Reads a child's stderr on a thread, logging it and keeping the last non-empty line."""

    def __init__(self, pipe: IO[bytes] | None, name: str) -> None:
        self.last = ""
        self._name = name
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True,
                                        name=f"runner-stderr-{name}")
        if pipe is not None:
            self._thread.start()

    def _read(self, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                if line:
                    self.last = line
                    log.debug("%s: %s", self._name, line)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)


def _error_text(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text.strip() or f"runner answered {response.status_code}"
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return f"runner answered {response.status_code}"


class RunnerProcess:
    """A spawned runner. `refs` counts the requests holding it; the scheduler's lock guards it."""

    def __init__(self, name: str, digest: str, port: int, process: subprocess.Popen[bytes],
                 size: int) -> None:
        self.name = name
        self.digest = digest
        self.port = port
        self.process = process
        self.size = size
        self.base_url = f"http://127.0.0.1:{port}"
        self.stderr = StderrTail(process.stderr, name)
        self.status: dict[str, Any] = {}
        self.refs = 0
        self.last_used = time.monotonic()
        self.keep_alive = 300.0
        self.expires_at: float | None = None
        self.broken = False
        self.stopping = False
        self.stop_when_idle = False
        self.ready: asyncio.Task[None]
        self._timer: asyncio.TimerHandle | None = None
        self._http: httpx.AsyncClient | None = None

    # -- state ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def is_ready(self) -> bool:
        ready = getattr(self, "ready", None)
        return bool(ready and ready.done() and not ready.cancelled()
                    and ready.exception() is None)

    def take(self) -> None:
        self.refs += 1
        self.stop_when_idle = False
        self.cancel_expiry()

    def arm_expiry(self, callback: Callable[[RunnerProcess], None]) -> None:
        """Call `callback(self)` once keep_alive seconds pass with no new request."""
        self.cancel_expiry()
        self.expires_at = time.time() + self.keep_alive
        self._timer = asyncio.get_running_loop().call_later(self.keep_alive, callback, self)

    def cancel_expiry(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.expires_at = None

    def expired(self) -> bool:
        return self.expires_at is not None and time.time() >= self.expires_at - 0.01

    def until(self) -> float | None:
        """Wall-clock time this runner will be unloaded if left idle; None means never."""
        if self.keep_alive < 0:
            return None
        if self.expires_at is not None:
            return self.expires_at
        return time.time() + max(self.keep_alive, 0.0)

    async def failure_message(self, cause: str = "") -> str:
        """Why the runner is gone: its exit status and last stderr line, once it has exited."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self.process.wait, 1.0)
        await asyncio.to_thread(self.stderr.join, 1.0)
        code = self.process.poll()
        if code is None:
            return f"lost connection to the runner for {self.name}: {cause or 'no response'}"
        text = f"runner process for {self.name} has terminated (exit status {code})"
        last = without_paths(self.stderr.last) if self.stderr.last else ""
        return f"{text}: {last}" if last else text

    # -- protocol ------------------------------------------------------------------------------

    @property
    def http(self) -> httpx.AsyncClient:
        """One keep-alive connection pool per runner, so a request costs no new TCP connection;
        made on first use (inside the event loop) and closed by `aclose`."""
        if self._http is None:
            self._http = httpx.AsyncClient(base_url=self.base_url,
                                           timeout=httpx.Timeout(None, connect=10.0))
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def wait_ready(self, timeout: float, interval: float) -> None:
        """Poll GET /v1/status until "ready"; raise RunnerError on exit, stop or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if self.stopping:
                raise RunnerError(f"the runner for {self.name} was stopped while loading")
            if not self.alive:
                raise RunnerError(await self.failure_message())
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = await self.http.get("/v1/status", timeout=2.0)
                if response.status_code == 200 and isinstance(response.json(), dict):
                    self.status = response.json()
                    if self.status.get("status") == "ready":
                        return
            if time.monotonic() > deadline:
                raise RunnerError(f"timed out waiting for {self.name} to load after "
                                  f"{timeout:g}s (FERRY_LOAD_TIMEOUT)")
            await asyncio.sleep(interval)

    async def complete(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST /v1/completions; yield each message up to and including the `done` one."""
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise RunnerError(_error_text(response), response.status_code)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    message = json.loads(line)
                    if "error" in message:
                        raise RunnerError(str(message["error"]))
                    yield message
                    if message.get("done"):
                        return
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            self.broken = True
            raise RunnerError(await self.failure_message(str(exc))) from exc
        self.broken = True
        raise RunnerError(await self.failure_message("the stream ended without a final message"))

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/embed: the runner's vectors and counters for one batch."""
        try:
            response = await self.http.post("/v1/embed", json=body)
            if response.status_code >= 400:
                raise RunnerError(_error_text(response), response.status_code)
            result = response.json()
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            self.broken = True
            raise RunnerError(await self.failure_message(str(exc))) from exc
        if not isinstance(result, dict):
            raise RunnerError("the runner's embed answer is not an object")
        return result

    # -- shutdown ------------------------------------------------------------------------------

    def stop(self, grace: float) -> None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL; returns once the child is reaped."""
        self.stopping = True
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("runner for %s ignored SIGTERM; killing it", self.name)
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait()
        self.stderr.join(1.0)
