"""A stand-in runner for the scheduler's failure-injection tests (not a model: no MLX).

It speaks docs/runner-protocol.md with the standard library only, so it starts in a fraction of
a second, and it can be told to misbehave: load slowly, die while loading with a message on
stderr, or stream slowly (so a test can kill it mid-request). The API and client tests use the real
runner (scripted fixture models for exact answers); this process exists to make failures happen
on demand.

    python fake_runner.py --model NAME --port P [--load-seconds S] [--die-on-load MSG]
                          [--token-delay S] [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--load-seconds", type=float, default=0.0)
    p.add_argument("--die-on-load", default="")
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--tokens", type=int, default=3)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--log", default="", help="append 'done N' or 'cut N' per completion")
    return p.parse_args()


ARGS = parse_args()
STARTED = time.monotonic()


def loaded() -> bool:
    return time.monotonic() - STARTED >= ARGS.load_seconds


def record(line: str) -> None:
    if ARGS.log:
        with open(ARGS.log, "a") as log:
            log.write(line + "\n")


def pieces(body: dict) -> list[str]:
    limit = (body.get("options") or {}).get("num_predict", ARGS.tokens)
    count = ARGS.tokens if limit is None or limit < 0 else min(limit, ARGS.tokens)
    return [f"tok{i} " for i in range(count)]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"request {format % args}\n")

    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/v1/status":
            return self.send_json(404, {"error": "not found"})
        ready = loaded()
        self.send_json(200, {"status": "ready" if ready else "loading",
                             "progress": 1.0 if ready else 0.5, "context_length": 4096,
                             "memory": {"rss": 1000, "weights": 100}, "compute": "float32",
                             "model": ARGS.model})

    def read_body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_POST(self) -> None:
        body = self.read_body()
        if self.path == "/v1/tokenize":
            return self.send_json(200, {"tokens": list(range(len(body.get("content", "")))) })
        if self.path != "/v1/completions":
            return self.send_json(404, {"error": "not found"})
        if body.get("options", {}).get("num_ctx") == -1:
            return self.send_json(400, {"error": "num_ctx must be positive"})
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        out = pieces(body)
        sent = 0
        try:
            for piece in out:
                time.sleep(ARGS.token_delay)
                self.chunk({"content": piece, "done": False})
                sent += 1
            self.chunk({"content": "", "done": True, "done_reason": "stop", "eval_count": sent,
                        "prompt_eval_count": 7, "prompt_eval_duration": 1000,
                        "eval_duration": 2000})
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            record(f"cut {sent}")  # the client went away: stop generating, as the real runner
            return
        record(f"done {sent}")

    def chunk(self, obj: dict) -> None:
        data = (json.dumps(obj) + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> None:
    from ferry.commands.runner import die_with_parent

    die_with_parent()  # the real runner's mechanism, so the orphan test proves it
    if ARGS.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler)
    if ARGS.die_on_load:
        def die() -> None:
            time.sleep(0.2)
            sys.stderr.write("loading weights\n")
            sys.stderr.write(ARGS.die_on_load + "\n")
            sys.stderr.flush()
            os._exit(3)
        threading.Thread(target=die, daemon=True).start()
    sys.stderr.write(f"fake runner for {ARGS.model} on {ARGS.port}\n")
    sys.stderr.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
