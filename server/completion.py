"""One completion through the scheduler, shared by the Ollama and OpenAI routes.

`run_completion` acquires a runner, streams its pieces and ends with one `Stats`. The answer
goes through server/output_parser.py, which splits reasoning (`Thinking`), text and tool calls
(`Calls`, each as soon as it is complete) as they stream; a `format` is enforced by the runner's
grammar, so that answer is plain text.
`start_stream` pulls the first item before a response is chosen, so an error before any output
(unknown model, failed load) is a plain HTTP error and one after it a final error line or event
(reference 4.1).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from server.chat_request import ModelDefaults
from server.json_format import JSONFormat
from server.output_parser import Calls, OutputParser, Thinking, ThinkMode, parser_for
from server.scheduler import Lease, Scheduler
from server.tool_calls import ToolCall


@dataclass
class Stats:
    """The final numbers of a completion; durations in nanoseconds, as Ollama reports them."""

    done_reason: str = "stop"
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    load_duration: int = 0
    total_duration: int = 0
    prompt_cached: int = 0  # of prompt_eval_count, tokens reused from the runner's prefix cache
    context: list[int] | None = None  # prompt and answer token ids, when the runner returned them

    def add_runner_final(self, message: dict[str, Any]) -> None:
        """The runner counts evaluated tokens; Ollama reports the whole prompt, cached or not."""
        self.done_reason = str(message.get("done_reason") or "stop")
        cached = int(message.get("prompt_cached") or 0)
        self.prompt_eval_count += int(message.get("prompt_eval_count") or 0) + cached
        self.prompt_cached += cached
        if isinstance(message.get("context"), list):
            self.context = message["context"]
        self.prompt_eval_duration += int(message.get("prompt_eval_duration") or 0)
        self.eval_count += int(message.get("eval_count") or 0)
        self.eval_duration += int(message.get("eval_duration") or 0)

    def ollama_fields(self) -> dict[str, Any]:
        return {"done_reason": self.done_reason, "total_duration": self.total_duration,
                "load_duration": self.load_duration,
                "prompt_eval_count": self.prompt_eval_count,
                "prompt_eval_duration": self.prompt_eval_duration,
                "eval_count": self.eval_count, "eval_duration": self.eval_duration,
                "prompt_cached_count": self.prompt_cached}


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of the tokens generated since the last piece (Ollama's entries)."""

    entries: list[dict[str, Any]]


Item = str | Thinking | Calls | Logprobs | Stats


@dataclass
class CompletionJob:
    """What to run: the runner request body (docs/runner-protocol.md) and how to hold the model."""

    scheduler: Scheduler
    model: ModelDefaults
    body: dict[str, Any]
    keep_alive: float | None
    fmt: JSONFormat | None
    started: float  # time.monotonic() when the request arrived
    tool_names: Collection[str] = field(default_factory=set)
    think: ThinkMode = ThinkMode.OFF


async def run_completion(job: CompletionJob) -> AsyncIterator[Item]:
    """Text pieces (and Calls), then one Stats. The runner is released however this ends."""
    lease = await job.scheduler.acquire(job.model, job.keep_alive)
    try:
        stats = Stats(load_duration=int(lease.load_duration * 1e9))
        async for piece in _parsed(lease, job, stats):
            yield piece
        stats.total_duration = int((time.monotonic() - job.started) * 1e9)
        yield stats
    finally:
        lease.release()


async def _plain(lease: Lease, body: dict[str, Any], stats: Stats,
                 parser: OutputParser | None = None) -> AsyncIterator[str | Logprobs]:
    async for message in lease.complete(body):
        if message.get("done"):
            stats.add_runner_final(message)
            continue
        if message.get("thinking_opened") and parser is not None:
            parser.open_thinking()
        if message.get("logprobs"):
            yield Logprobs(list(message["logprobs"]))
        if message.get("content"):
            yield str(message["content"])


async def _parsed(lease: Lease, job: CompletionJob,
                  stats: Stats) -> AsyncIterator[str | Thinking | Calls | Logprobs]:
    # a grammar-constrained answer is the JSON itself: nothing in it is reasoning
    parser = parser_for(ThinkMode.OFF if job.fmt is not None else job.think, job.tool_names,
                        job.model.config.model_family or "", job.model.template)
    async for text in _plain(lease, job.body, stats, parser):
        if isinstance(text, Logprobs):
            yield text
            continue
        for piece in parser.feed(text):
            yield piece
    for piece in parser.finish():
        yield piece


async def start_stream(items: AsyncIterator[Item]) -> tuple[Item | None, AsyncIterator[Item]]:
    """Run `items` up to its first item (raising any error before output) and hand back both."""
    try:
        first = await anext(items)
    except StopAsyncIteration:
        return None, items
    return first, items


class ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


@dataclass
class Answer:
    """A whole completion, for non-streaming responses."""

    text: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    logprobs: list[dict[str, Any]] | None = None


async def collect_while_connected(items: AsyncIterator[Item],
                                  is_disconnected: Callable[[], Awaitable[bool]],
                                  poll: float = 0.25) -> Answer:
    """`collect`, but a client that goes away cancels the generation (and frees the runner)."""
    task = asyncio.ensure_future(collect(items))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll)
            if done:
                return task.result()
            if await is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


async def collect(items: AsyncIterator[Item]) -> Answer:
    """The whole text, reasoning, tool calls and the final Stats."""
    answer = Answer()
    async for item in items:
        if isinstance(item, Stats):
            answer.stats = item
        elif isinstance(item, Calls):
            answer.calls += item.calls
        elif isinstance(item, Thinking):
            answer.thinking += item.text
        elif isinstance(item, Logprobs):
            answer.logprobs = (answer.logprobs or []) + item.entries
        else:
            answer.text += item
    return answer
