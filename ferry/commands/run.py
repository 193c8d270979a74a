"""`ferry run | ps | stop`: chat with a model, list the loaded ones, unload one.

All three are clients of the model server, like the `ollama` CLI: `run` pulls the model if the
store lacks it, then streams /api/chat (one prompt from the arguments or stdin, else an
interactive session), `ps` reads /api/ps and `stop`
sends Ollama's unload request (an empty prompt with `keep_alive: 0`). Nothing starts a server
unless FERRY_AUTOSTART=1, in which case `run` starts `ferry serve` in the background.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from ferry.answer_printer import AnswerPrinter
from ferry.chat_commands import LEVELS, handle_command
from ferry.client import CLIError, ServerClient
from ferry.commands.models import human_bytes, human_time, table
from ferry.config import Settings
from ferry.image_paths import extract_images
from ferry.progress import show_progress
from server.scheduler import runner_env

FOREVER = timedelta(days=365 * 100)


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="run a model: answer one prompt, or chat interactively")
    run.add_argument("model", help="model name, e.g. me/tiny or llama3:8b")
    run.add_argument("prompt", nargs="*", help="the prompt; without one, start a chat")
    run.add_argument("--format", help='"json" or a JSON schema the answer must match')
    run.add_argument("--keepalive", help="how long the model stays loaded (5m, 1h, 0, -1)")
    run.add_argument("--verbose", action="store_true", help="print timings after each answer")
    run.add_argument("--think", choices=["true", "false", *LEVELS],
                     help="let a reasoning model think first; a level or false goes after "
                          "an equals sign: --think=high, --think=false")
    run.add_argument("--hidethinking", action="store_true",
                     help="reason, but print only the answer")
    run.add_argument("--nowordwrap", action="store_true",
                     help="do not wrap words at the terminal width")
    run.add_argument("--insecure", action="store_true",
                     help="when pulling, allow a private registry over plain http")
    run.set_defaults(func=run_model, words_continue="prompt")

    ps = sub.add_parser("ps", help="list the models loaded in runners")
    ps.set_defaults(func=run_ps)

    stop = sub.add_parser("stop", help="unload a running model")
    stop.add_argument("model")
    stop.set_defaults(func=run_stop)


def attach_flag_defaults(argv: Sequence[str]) -> list[str]:
    """A bare `--think` means `--think=true`, and only `--think=LEVEL` carries a level, as in
    Ollama's CLI: `ferry run m --think "why?"` then reads "why?" as the prompt, not the level.
    Arguments after `--` are left alone."""
    out: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[index:])
        out.append("--think=true" if arg == "--think" else arg)
    return out


# -- run -------------------------------------------------------------------------------------------

class Chat:
    """One conversation with a model through /api/chat; keeps the history."""

    def __init__(self, client: ServerClient, args: argparse.Namespace) -> None:
        self.client = client
        self.model = args.model
        self.verbose = args.verbose
        self.messages: list[dict[str, Any]] = []
        self.vision: bool | None = None  # asked of /api/show before the first message
        self.system: str | None = None
        self.options: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.think: bool | str | None = _think_value(args.think)
        self.hide_thinking = bool(args.hidethinking)
        self.wordwrap = sys.stdout.isatty() and not args.nowordwrap
        if args.keepalive is not None:
            self.extra["keep_alive"] = args.keepalive
        if args.format:
            self.extra["format"] = _parse_format(args.format)

    def load(self, timeout: float) -> None:
        """Load the model before the first prompt (and fail early if it does not exist)."""
        self.client.request("POST", "/api/generate", {"model": self.model, **self.extra},
                            timeout=timeout)

    def _user_message(self, text: str) -> dict[str, Any]:
        """The user's message; for a vision model, with the images whose paths it names."""
        if self.vision is None:
            shown = self.client.request("POST", "/api/show", {"model": self.model}).json()
            self.vision = "vision" in (shown.get("capabilities") or [])
        if not self.vision:
            return {"role": "user", "content": text}
        text, images = extract_images(text)
        return {"role": "user", "content": text, **({"images": images} if images else {})}

    def send(self, text: str) -> str:
        """Stream the answer to `text` onto stdout; the exchange joins the history."""
        request = [*self.messages, self._user_message(text)]
        system = [{"role": "system", "content": self.system}] if self.system else []
        body = {"model": self.model, "messages": [*system, *request], "stream": True,
                **self.extra}
        if self.options:
            body["options"] = self.options
        if self.think is not None:
            body["think"] = self.think
        printer = AnswerPrinter(show_thinking=not self.hide_thinking, wrap=self.wordwrap)
        final: dict[str, Any] = {}
        for event in self.client.stream("/api/chat", body):
            message = event.get("message") or {}
            printer.thinking(message.get("thinking") or "")
            printer.content(message.get("content") or "")
            if event.get("done"):
                final = event
        reply = {"role": "assistant", "content": printer.answer}
        if printer.reasoning:
            reply["thinking"] = printer.reasoning  # passed back, as Ollama does
        self.messages = [*request, reply]
        printer.end()
        if self.verbose:  # after the answer's line, never glued to it
            print_stats(final)
        return printer.answer


def _think_value(value: str | None) -> bool | str | None:
    if value is None or value in LEVELS:
        return value
    return value == "true"


def _parse_format(value: str) -> Any:
    if value == "json":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise CLIError(f'--format must be "json" or a JSON schema: {exc}') from exc


def print_stats(final: dict[str, Any]) -> None:
    """`--verbose`: Ollama's timing summary, on stderr so stdout stays the answer."""
    def seconds(key: str) -> float:
        return float(final.get(key) or 0) / 1e9

    lines = [("total duration", f"{seconds('total_duration'):.6f}s"),
             ("load duration", f"{seconds('load_duration'):.6f}s")]
    for prefix, label in (("prompt_eval", "prompt eval"), ("eval", "eval")):
        count, took = int(final.get(f"{prefix}_count") or 0), seconds(f"{prefix}_duration")
        lines.append((f"{label} count", f"{count} token(s)"))
        lines.append((f"{label} duration", f"{took:.6f}s"))
        if took > 0:
            lines.append((f"{label} rate", f"{count / took:.2f} tokens/s"))
    for label, value in lines:
        print(f"{label + ':':<22}{value}", file=sys.stderr)


def run_model(args: argparse.Namespace, settings: Settings) -> int:
    prompt = " ".join(args.prompt)
    if not sys.stdin.isatty():
        piped = sys.stdin.read()
        prompt = f"{piped}\n{prompt}".strip() if prompt else piped.strip()
    ensure_server(settings)
    with ServerClient(settings) as client:
        if not client.has_model(args.model):
            pull(client, args.model, args.insecure)
        chat = Chat(client, args)
        if prompt:
            chat.send(prompt)
            return 0
        chat.load(timeout=settings.load_timeout + 30)
        return interactive(chat)


def pull(client: ServerClient, model: str, insecure: bool) -> None:
    """Pull a model the store lacks, with progress on stderr, as `ollama run` does."""
    body = {"model": model, "insecure": insecure, "stream": True}
    last = show_progress(client.stream("/api/pull", body))
    if last.get("status") != "success":
        raise CLIError(f"pulling {model} ended without success: {last}")


def read_message(first: str) -> str:
    """The rest of a message that started with `\"\"\"`: lines up to the closing quotes."""
    text = first[3:]
    if text.endswith('"""') and len(text) >= 3:
        return text[:-3]
    lines = [text] if text else []
    while True:
        line = input("... ")
        if '"""' in line:
            lines.append(line[: line.index('"""')])
            return "\n".join(lines)
        lines.append(line)


def interactive(chat: Chat) -> int:
    """The `>>>` loop: `\"\"\"` for multi-line input, `/bye` to leave, history kept."""
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and up-arrow history for input())
    while True:
        try:
            line = input(">>> ")
            text = read_message(line) if line.startswith('"""') else line
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("\nUse Ctrl + d or /bye to exit.")
            continue
        if not text.strip():
            continue
        if text.startswith("/"):
            if handle_command(chat, text.strip()):
                return 0
            continue
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C stops this answer only
            chat.send(text)
        print()


# -- autostart -------------------------------------------------------------------------------------

def _server_up(settings: Settings) -> bool:
    try:
        with ServerClient(settings, timeout=2.0) as client:
            client.request("GET", "/api/version")
        return True
    except CLIError:
        return False


def ensure_server(settings: Settings, wait: float = 30.0) -> None:
    """With FERRY_AUTOSTART=1, start `ferry serve` in the background if nothing answers."""
    if not settings.autostart or _server_up(settings):
        return
    log_dir = settings.home / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "server.log", "ab") as log:
        subprocess.Popen([sys.executable, "-P", "-m", "ferry.cli", "serve"],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         env=runner_env(settings), start_new_session=True)
    deadline = time.monotonic() + wait
    while not _server_up(settings):
        if time.monotonic() > deadline:
            raise CLIError(f"started `ferry serve` but it did not answer within {wait:g}s; "
                           f"see {log_dir / 'server.log'}")
        time.sleep(0.2)


# -- ps and stop -----------------------------------------------------------------------------------

def until_text(expires_at: str, now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    try:
        moment = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    if moment - now > FOREVER:
        return "Forever"
    if moment <= now:
        return "Stopping..."
    return human_time(moment.isoformat(), now)


def run_ps(args: argparse.Namespace, settings: Settings) -> int:
    with ServerClient(settings) as client:
        models = client.request("GET", "/api/ps").json().get("models", [])
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]]
    for model in models:
        compute = model.get("compute")
        processor = "100% CPU" + (f" ({compute})" if compute else "")
        rows.append([model.get("name", ""), str(model.get("digest", ""))[:12],
                     human_bytes(int(model.get("size", 0))), processor,
                     str(model.get("context_length", "")),
                     until_text(str(model.get("expires_at", "")))])
    print(table(rows))
    return 0


def run_stop(args: argparse.Namespace, settings: Settings) -> int:
    from registry.names import Name

    wanted = Name.parse(args.model)
    with ServerClient(settings) as client:
        loaded = client.request("GET", "/api/ps").json().get("models", [])
        if not any(Name.parse(m.get("name", "")) == wanted for m in loaded):
            raise CLIError(f'couldn\'t find model "{args.model}" to stop')
        client.request("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    return 0
