#!/usr/bin/env python3
"""Benchmark: GGUF models in ferry's runner beside the safetensors int8/int4 models of the same
fixture checkpoint, same run (issue 13). An extension of bench/runner.py, whose model building and
runner driving it reuses.

    .venv/bin/python bench/runner_gguf.py [--presets small] [--kinds int8,int4,Q8_0,Q4_0,Q4_K]

For each kind: the fixture checkpoint becomes a ferry model, by `create -q` (int8/int4) or by
exporting it to GGUF the way llama.cpp's converter does (tests/runner/gguf_export.py; Q4_K is
"Q4_K_M"-like, Q6_K for ffn_down and output) and creating from that file. A real `ferry runner`
process loads it and streams one raw completion (prefill and decode tok/s from the runner's own
durations). Load time is from spawning the runner to its first "ready" status (Python start-up
and imports included, the same for every row). Peak RSS is the runner's VmHWM after the request
(bench/runner.py's `vm_hwm`: the process's own high-water mark, prefill and decode included);
"load RSS" is its VmHWM at "ready", the load's own peak. The target for GGUF rows: peak RSS <=
1.3x (file size + KV cache at the context the request uses: its prompt, the part the prefix
cache supplied from the warm-up included, and its generated tokens, rounded up to the cache's
256-token steps, 2 bytes a value as the runner stores it: float16
on a CPU too, where activations are float32), net of the runner's own footprint: the peak RSS
of the same runner serving the tiny fixture model (~1M parameters) the same way, shown as the
"base" row, less that model's own weights and KV cache (they are the model's, not the
runner's; counting them as footprint flattered every row by ~2.5 MiB). On a CPU's native path
an untied token embedding is not loaded but read from the file a few rows per lookup
(runner/gguf_embedding.py): its bytes sit in the page cache, not in the runner's RSS, and the
"weights" the runner reports leave it out; symmetric types (Q4_0, Q8_0, Q6_K) hold no biases
(runner/nn/quantized.py).
FERRY_COMPUTE defaults to native here: "auto" picks float32 on a CPU when it fits, which is
faster but holds 4 bytes per weight, so it is not what this memory target is about. MLX's
quantized CPU kernels are slow (~1 s per token for the small preset), so on a CPU keep
--prompt-tokens and --gen-tokens small.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "runner"))
_spec = importlib.util.spec_from_file_location("bench_runner", REPO / "bench" / "runner.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # bench/runner.py (its name would shadow the runner package)

GGUF_KINDS = ("Q8_0", "Q4_0", "Q4_K")
RSS_TARGET = 1.3
_ready_seconds: list[float] = []
_ready_peaks: list[int] = []  # the runner's VmHWM once ready: the load's own peak
_ready_weights: list[int] = []  # the weights' bytes, as the runner reports them
_wait_ready = bench._wait_ready


def _timed_wait_ready(url: str, process: subprocess.Popen) -> dict:
    """bench/runner.py's readiness poll, timed (it starts right after the spawn), and the
    runner's peak RSS at that point."""
    started = time.perf_counter()
    status = _wait_ready(url, process)
    _ready_seconds.append(time.perf_counter() - started)
    _ready_peaks.append(bench.vm_hwm(process.pid))
    _ready_weights.append(int(status.get("memory", {}).get("weights", 0)))
    return status


bench._wait_ready = _timed_wait_ready


def gguf_model(workdir: Path, ckpt: Path, preset: str, kind: str) -> tuple[str, int]:
    """Create `bench/llama-<preset>:<kind>` from an exported GGUF; (name, file size)."""
    from gguf_export import export_gguf

    from registry.errors import NotFound
    from registry.names import Name
    from registry.store import Store
    from workflows.create import CreateOptions, GGUFFiles, create

    store, name = Store(workdir / "store"), f"bench/llama-{preset}:{kind.lower()}"
    path = workdir / f"llama-{preset}-{kind}.gguf"
    if not path.is_file():
        print(f"exporting {path.name} ...", flush=True)
        export_gguf(ckpt, path, kind)
    try:
        store.get_model(Name.parse_valid(name))
    except NotFound:
        digest = store.blob_writer().write_all(path.read_bytes())
        create(Name.parse(name), GGUFFiles({path.name: digest}), CreateOptions(), store,
               lambda e: None, threading.Event())
    return name, path.stat().st_size


def kv_cache_bytes(ckpt: Path, tokens: int, dtype_bytes: int = 2) -> int:
    """The runner's KV cache for `tokens` positions (it grows in 256-token steps), float16 or
    bfloat16 as the GGUF and the bf16 fixture both compute."""
    config = json.loads((ckpt / "config.json").read_text())
    capacity = -(-tokens // 256) * 256
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
            * capacity * dtype_bytes)


def run_row(workdir: Path, ckpt: Path, preset: str, kind: str, args: argparse.Namespace
            ) -> dict:
    if kind == "base":
        ckpt = bench.checkpoint(workdir, "tiny")
        name, size = bench.ferry_model(workdir, ckpt, "tiny", "bf16"), 0
    elif kind in GGUF_KINDS:
        name, size = gguf_model(workdir, ckpt, preset, kind)
    else:
        name, size = bench.ferry_model(workdir, ckpt, preset, kind), 0
    prompt = bench.prompt_text(ckpt, args.prompt_tokens)
    result = bench.run_ferry(workdir, name, prompt, args.gen_tokens, args.compute)
    result.update(kind=kind, file=size, load=_ready_seconds[-1], load_rss=_ready_peaks[-1],
                  weights=_ready_weights[-1],
                  kv=kv_cache_bytes(ckpt, result["prompt_tokens"] + result["prompt_cached"]
                                    + result["gen_tokens"]))
    return result


def print_table(rows: list[tuple[str, dict]]) -> None:
    head = (f"{'model':<14}{'compute':<18}{'file':>9}{'KV':>7}{'load s':>8}{'prefill t/s':>13}"
            f"{'decode t/s':>12}{'load RSS':>10}{'peak RSS':>10}{'net/(file+KV)':>15}")
    print("\n" + head + "\n" + "-" * len(head))
    # the runner's own footprint: the base row's peak less its (tiny) model's weights and KV
    base = next((r["rss"] - r["weights"] - r["kv"] for _, r in rows if r["kind"] == "base"), 0)
    for preset, r in rows:
        budget, net = r["file"] + r["kv"], r["rss"] - base
        ratio = (f"{net / budget:.2f}x" + (" ok" if net <= RSS_TARGET * budget
                                           else f" >{RSS_TARGET}x")) if r["file"] else "-"
        file = f"{r['file'] / 2**20:.0f}Mi" if r["file"] else "-"
        print(f"{preset + ' ' + r['kind']:<14}{r['compute']:<18}{file:>9}"
              f"{r['kv'] / 2**20:>5.1f}Mi{r['load']:>8.1f}{r['prefill']:>13.1f}"
              f"{r['decode']:>12.2f}{r['load_rss'] / 2**20:>8.0f}Mi{r['rss'] / 2**20:>8.0f}Mi"
              f"{ratio:>15}")
    print(f"runner footprint (base peak less its model's weights and KV): {base / 2**20:.1f}Mi")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small")
    parser.add_argument("--kinds", default="base,int8,int4,Q8_0,Q4_0,Q4_K")
    parser.add_argument("--workdir", default="/tmp/ferry-bench")
    parser.add_argument("--compute", default="native", help="FERRY_COMPUTE for the runner")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--gen-tokens", type=int, default=64)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        ckpt = bench.checkpoint(workdir, preset)
        for kind in args.kinds.split(","):
            print(f"{preset} {kind} ...", flush=True)
            rows.append((preset, run_row(workdir, ckpt, preset, kind, args)))
    print_table(rows)


if __name__ == "__main__":
    main()
