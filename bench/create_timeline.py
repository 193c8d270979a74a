#!/usr/bin/env python3
"""A timeline of one `ferry create --quantize` (server and CLI), beside `mlx_lm.convert`'s.

    .venv/bin/python bench/create_timeline.py --checkpoint DIR [--type int4]

Runs `ferry serve` and `ferry create` each under this file as a wrapper (`--wrap`), which
patches a few functions to append timestamped events (wall clock, the process's CPU seconds, the
thread) to one JSONL file: each upload's first and last byte sent (CLI) and received (server),
every background fdatasync and fsync, each tensor quantized, each result blob written, the
upload commit, the verify wait, the manifest write, CLI start and exit. Nothing in ferry is
changed; the patches exist only in the processes this script starts. Prints the events relative
to the CLI's start, then mlx_lm.convert's wall and CPU time on the same checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PYTHON = sys.executable
_LOCK = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    path = os.environ["FERRY_TIMELINE"]
    times = os.times()
    record = {"t": time.time(), "cpu": round(times.user + times.system, 3),
              "tcpu": time.thread_time(),
              "pid": os.getpid(), "thread": threading.current_thread().name,
              "tid": threading.get_native_id(), "event": event,
              **fields}
    with _LOCK, open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def traced(owner: Any, name: str, label: str, describe: Any = None) -> None:
    """Wrap `owner.name` to emit `<label> start` / `<label> end` around each call."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        extra = describe(*args, **kwargs) if describe else {}
        emit(f"{label} start", **extra)
        try:
            return original(*args, **kwargs)
        finally:
            emit(f"{label} end", **extra)

    setattr(owner, name, wrapper)


def patch_server() -> None:
    from registry import blob_writer, upload_sessions
    from registry.store import Store
    from workflows.create import arrivals, blob_batch, write

    traced(os, "fdatasync", "fdatasync")
    traced(os, "fsync", "fsync")
    traced(upload_sessions.Upload, "commit", "upload commit")
    traced(arrivals.Arrivals, "wait_verified", "wait verified")
    traced(blob_batch.BlobBatch, "_write", "blob write")
    traced(blob_batch.BlobBatch, "close", "batch close")
    traced(write, "_quantized_parts", "quantize", lambda t, s: {"tensor": t.name})
    traced(Store, "write_manifest", "manifest")
    # Where the received bytes are written (`write` before receive handed over its pieces).
    method = "write_chunks" if hasattr(blob_writer.BlobWriter, "write_chunks") else "write"
    original_write = getattr(blob_writer.BlobWriter, method)
    seen: set[int] = set()

    def write_chunks(self: Any, chunks: Any) -> None:
        if id(self) not in seen and self.hasher.size == 0:
            seen.add(id(self))
            emit("receive first byte")
        emit("receive write start")
        original_write(self, chunks)
        emit("receive write end")
        if self.expected_size is not None and self.hasher.size == self.expected_size:
            emit("receive last byte")

    setattr(blob_writer.BlobWriter, method, write_chunks)


def patch_cli() -> None:
    import atexit

    from ferry.commands import create

    emit("cli start")
    atexit.register(lambda: emit("cli exit"))
    original_chunks = create._chunks

    def chunks(path: Path, on_chunk: Any) -> Any:
        emit("send first byte", file=path.name)
        yield from original_chunks(path, on_chunk)
        emit("send last byte", file=path.name)

    create._chunks = chunks
    traced(create, "_render", "render (create request)")


def wrap(role: str, argv: list[str]) -> None:
    patch_server() if role == "server" else patch_cli()
    sys.argv = ["ferry", *argv]
    profile_to = os.environ.get("FERRY_TIMELINE_PROFILE") if role == "server" else None
    if not profile_to:
        runpy.run_module("ferry.cli", run_name="__main__")
        return
    import cProfile  # the main thread only: the server's event loop

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        runpy.run_module("ferry.cli", run_name="__main__")
    finally:
        profiler.disable()
        profiler.dump_stats(profile_to)


def show(path: Path) -> None:
    events = [json.loads(line) for line in path.read_text().splitlines()]
    t0 = min(e["t"] for e in events if e["event"] == "cli start")
    cli_pids = {e["pid"] for e in events if e["event"] == "cli start"}
    pids = {e["pid"]: "cli" if e["pid"] in cli_pids else "server" for e in events}
    squash = ("fdatasync", "fsync", "quantize", "blob write", "receive write")
    counts: dict[str, list[float]] = {}
    cpu: dict[str, float] = {}
    opened: dict[tuple[str, int, str], dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        who = pids.get(e["pid"]) or "server"
        key = e["event"].rsplit(" ", 1)[0]
        if key in squash:  # many: print a summary line per kind instead, plus first/last
            counts.setdefault(key, [])
            if e["event"].endswith("start"):
                opened[(key, e["pid"], e["thread"])] = e
            elif (begin := opened.pop((key, e["pid"], e["thread"]), None)) is not None:
                counts[key].append(e["t"] - begin["t"])
                cpu[key] = cpu.get(key, 0.0) + e["tcpu"] - begin["tcpu"]
        rel = e["t"] - t0
        if key in squash and e["event"].endswith("start"):
            continue
        if key in squash:
            continue
        extra = {k: v for k, v in e.items() if k not in ("t", "cpu", "pid", "thread", "event")}
        print(f"{rel:8.2f}s  {who:6} cpu={e['cpu']:7.2f}  {e['event']:28} {extra or ''}")
    for key, spans in counts.items():
        starts = [e["t"] - t0 for e in events if e["event"] == f"{key} start"]
        ends = [e["t"] - t0 for e in events if e["event"] == f"{key} end"]
        print(f"{key:12} n={len(spans):4}  busy {sum(spans):6.2f}s  cpu {cpu[key]:6.2f}s  "
              f"first start {min(starts):7.2f}s  last end {max(ends):7.2f}s")
    last = [e for e in events if e["event"].startswith(("quantize", "blob write",
                                                       "fsync", "fdatasync"))]
    print("last 12 heavy events:")
    for e in sorted(last, key=lambda e: e["t"])[-12:]:
        print(f"  {e['t'] - t0:8.2f}s {e['thread']:24} {e['event']} {e.get('tensor', '')}")


def thread_cpu(pid: int, log: Path) -> None:
    """CPU seconds of each server thread (named from the events, else by its OS name)."""
    names = {}
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e["pid"] == pid:
            names[e["tid"]] = e["thread"]
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        comm = (task / "comm").read_text().strip()
        rows.append((seconds, f"{names.get(int(task.name), comm)}[{task.name}]"))
    print("server threads:", ", ".join(f"{n} {s:.2f}s" for s, n in sorted(rows)[::-1] if s))
    print("threads by id:", {tid: name for tid, name in names.items()})


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--wrap":
        wrap(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--type", default="int4")
    parser.add_argument("--no-mlx-lm", action="store_true")
    args = parser.parse_args()
    import psutil

    from bench.create import MLX_LM_ARGS, _wait_ready, free_port, warm_page_cache

    work = Path(tempfile.mkdtemp(prefix="ferry-timeline-"))
    log = work / "timeline.jsonl"
    port = free_port()
    env = {**os.environ, "FERRY_HOME": str(work / "home"), "FERRY_HOST": f"127.0.0.1:{port}",
           "FERRY_TIMELINE": str(log), "PYTHONPATH": str(REPO)}
    me = str(Path(__file__).resolve())
    server = subprocess.Popen([PYTHON, me, "--wrap", "server", "serve"], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port)
        cpu0 = sum(psutil.Process(server.pid).cpu_times()[:2])
        (work / "Modelfile").write_text(f"FROM {args.checkpoint}\n")
        warm_page_cache(args.checkpoint)
        print(f"load {os.getloadavg()}")
        start = time.time()
        cli = subprocess.run([PYTHON, me, "--wrap", "cli", "create", f"t/m:{args.type}", "-f",
                              str(work / "Modelfile"), "--quantize", args.type], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        wall = time.time() - start
        if cli.returncode:
            print(cli.stderr.decode()[-2000:])
        cli_cpu = sum(os.times()[2:4])
        server_cpu = sum(psutil.Process(server.pid).cpu_times()[:2]) - cpu0
        show(log)
        thread_cpu(server.pid, log)
        print(f"ferry: wall {wall:.2f}s  cli cpu {cli_cpu:.2f}s  server cpu {server_cpu:.2f}s"
              f"  load {os.getloadavg()}")
    finally:
        server.send_signal(signal.SIGINT)  # a profile, if asked for, is written on the way out
        server.wait(timeout=30)
    if not args.no_mlx_lm:
        out = work / "mlx"
        warm_page_cache(args.checkpoint)
        before = os.times()
        start = time.time()
        subprocess.run([PYTHON, "-m", "mlx_lm", "convert", "--hf-path", str(args.checkpoint),
                        "--mlx-path", str(out), "-q", *MLX_LM_ARGS[args.type]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        after = os.times()
        print(f"mlx_lm.convert: wall {time.time() - start:.2f}s  cpu "
              f"{(after[2] + after[3]) - (before[2] + before[3]):.2f}s  load {os.getloadavg()}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
