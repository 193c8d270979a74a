#!/usr/bin/env python3
"""Benchmark: ferry's runner versus mlx-lm on MLX's CUDA backend, in one process, same run.

    python3 bench/runner_cuda.py [--presets small,medium] [--quants bf16,int4] [--out FILE]

Made for a lent GPU machine, where ferry's server stack is not installed: only MLX (with its
CUDA backend), mlx-lm and the runner's own imports are needed. For each (preset, quant) ferry
creates the model from the fixture checkpoint (workflows.create, as `ferry create` does), loads
it as the runner does (`load_model`, FERRY_COMPUTE auto: the native path on a GPU) and generates
with the runner's `Generator` (prefill of a --prompt-tokens prompt, then --gen-tokens greedy
tokens; rates from its own prompt_eval/eval durations). mlx-lm loads the same checkpoint (for
int4, `mlx_lm.convert -q --q-bits 4 --q-group-size 64` of it) and runs `stream_generate` on the
same token ids. Both get a warm-up request with the same prompt first (a GPU compiles kernels
for each new shape), then --rounds; each rate's best round is shown, and every round's too.
Also printed: the device's peak memory for each side (mx.get_peak_memory, reset in between) and how
many of the first greedy tokens agree (bf16 rows: the two should agree on most of them; both
compute in bf16 on a GPU, so late divergence on a near-tie is expected). Works on
CPU too (slowly), which is how it is tested before it goes to a GPU.

Measured 2026-12-04 on a lent NVIDIA H200 (MLX 0.32.4 with mlx-cuda-13, mlx-lm 0.32.2; 512-token
prompt, 256 greedy tokens, best of 4 rounds; ferry / mlx-lm):

    small  bf16  decode 643 / 597 tok/s (1.08x)  prefill 71.0k / 62.5k (1.14x)  peak 350 / 343 MiB
    small  int4  decode 633 / 653 tok/s (0.97x)  prefill 66.3k / 67.0k (0.99x)  peak 237 / 190 MiB
    medium bf16  decode 253 / 261 tok/s (0.97x)  prefill 32.4k / 30.2k (1.07x)  peak 1243 / 1200 MiB
    medium int4  decode 280 / 253 tok/s (1.11x)  prefill 28.4k / 25.3k (1.12x)  peak 870 / 686 MiB

Rounds vary by ~15% on both sides (these models are small for the GPU: decode is launch-bound).
int4 peaks differ by design: ferry's int4 is Ollama's (group 32, k/v/down and the head at 8 bits),
mlx-lm's is group 64 throughout, which is also why their greedy tokens differ. A process's first
forward pass of a model is slow on CUDA (MLX compiles its kernels then: ferry's small bf16 8.8 s,
mlx-lm's 4.7 s after it, ferry's small int4 72.6 s after both), hence the full-prompt warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("FERRY_SHARED_DIR", REPO / "shared" if (REPO / "shared").is_dir()
                             else REPO.parent / "shared"))


def checkpoint(workdir: Path, preset: str) -> Path:
    out = workdir / f"llama-{preset}"
    if not (out / "config.json").is_file():
        print(f"building the {preset} fixture checkpoint ...", flush=True)
        subprocess.run([sys.executable, str(SHARED / "fixtures" / "make_checkpoint.py"),
                        "--out", str(out), "--arch", "llama", "--preset", preset, "--force"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


COMPUTE = "auto"


def ferry_side(workdir: Path, ckpt: Path, preset: str, quant: str, prompt: list[int],
               gen: int, rounds: int) -> dict:
    import mlx.core as mx

    from registry.names import Name
    from registry.store import Store
    from runner.generate import Done, Generator
    from runner.load import load_model
    from runner.quant import parse_quant_type
    from runner.sample import Options
    from runner.tokenizer import ModelTokenizer
    from workflows.create import CreateOptions, create

    store, name = Store(workdir / "store"), f"bench/llama-{preset}:{quant}"
    options = CreateOptions(quantize=None if quant == "bf16" else parse_quant_type(quant))
    started = time.perf_counter()
    create(Name.parse(name), ckpt, options, store, lambda e: None, threading.Event())
    created = time.perf_counter() - started
    mx.reset_peak_memory()
    started = time.perf_counter()
    loaded = load_model(store, name, COMPUTE)
    load_s = time.perf_counter() - started
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: the length is num_predict's
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    greedy = Options(temperature=0.0, num_predict=gen)
    list(generator.generate(prompt, Options(temperature=0.0, num_predict=8)))  # warm-up
    runs = []
    for _ in range(rounds):
        generator.prefix_cache.clear()  # every round evaluates the whole prompt
        pieces = list(generator.generate(prompt, greedy))
        done = pieces[-1]
        assert isinstance(done, Done)
        evaluated = done.prompt_eval_count
        runs.append({"prefill": evaluated / (done.prompt_eval_duration / 1e9),
                     "decode": done.eval_count / (done.eval_duration / 1e9),
                     "prompt_evaluated": evaluated, "prompt_cached": done.prompt_cached,
                     "tokens": generator.tokens[:32]})
    best = _best(runs)
    best.update(compute=loaded.compute, load_s=load_s, create_s=created,
                peak_mib=mx.get_peak_memory() / 2**20)
    return best


def mlx_lm_side(workdir: Path, ckpt: Path, preset: str, quant: str, prompt: list[int],
                gen: int, rounds: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    path = ckpt
    if quant != "bf16":
        path = workdir / f"mlx-lm-{preset}-{quant}"
        if not (path / "config.json").is_file():
            from mlx_lm import convert
            convert(str(ckpt), mlx_path=str(path), quantize=True,
                    q_bits={"int4": 4, "int8": 8}[quant], q_group_size=64)
    mx.reset_peak_memory()
    started = time.perf_counter()
    model, tokenizer = load(str(path))
    load_s = time.perf_counter() - started
    sampler = make_sampler(temp=0.0)
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=8, sampler=sampler):
        pass  # warm-up
    runs = []
    for _ in range(rounds):
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=gen,
                                         sampler=sampler))
        last = responses[-1]
        runs.append({"prefill": last.prompt_tps, "decode": last.generation_tps,
                     "tokens": [int(r.token) for r in responses[:32]]})
    best = _best(runs)
    best.update(load_s=load_s, peak_mib=mx.get_peak_memory() / 2**20)
    return best


def _best(runs: list[dict]) -> dict:
    """Each rate's best round (a GPU's first run of a shape may compile kernels), and every
    round's rates as measured."""
    best = dict(runs[0])
    best["prefill"] = max(r["prefill"] for r in runs)
    best["decode"] = max(r["decode"] for r in runs)
    best["rounds"] = [(round(r["prefill"], 1), round(r["decode"], 1)) for r in runs]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--quants", default="bf16,int4")
    parser.add_argument("--workdir", default="/tmp/ferry-bench-cuda")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compute", default="auto", help="FERRY_COMPUTE for ferry's side")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    global COMPUTE
    COMPUTE = args.compute

    import mlx.core as mx

    print(f"MLX {mx.__version__} on {mx.default_device()}", flush=True)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        ckpt = checkpoint(workdir, preset)
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        prompt = [5 + (7919 * i + 13) % (vocab - 5) for i in range(args.prompt_tokens)]
        for quant in args.quants.split(","):
            row: dict = {"preset": preset, "quant": quant}
            for side, run in (("ferry", ferry_side), ("mlx_lm", mlx_lm_side)):
                try:
                    row[side] = run(workdir, ckpt, preset, quant, prompt, args.gen_tokens,
                                    args.rounds)
                except Exception as exc:  # report and go on: one failure must not end the run
                    import traceback
                    traceback.print_exc()
                    row[side] = {"error": f"{type(exc).__name__}: {exc}"}
                mx.clear_cache()
            rows.append(row)
            _print_row(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def _print_row(row: dict) -> None:
    ours, theirs = row["ferry"], row["mlx_lm"]
    label = f"{row['preset']:<7} {row['quant']:<5}"
    if "error" in ours or "error" in theirs:
        print(f"{label} ferry: {ours.get('error', 'ok')} | mlx-lm: {theirs.get('error', 'ok')}",
              flush=True)
        return
    same = 0
    for a, b in zip(ours["tokens"], theirs["tokens"], strict=False):
        if a != b:
            break
        same += 1
    print(f"{label} decode {ours['decode']:8.1f} vs {theirs['decode']:8.1f} tok/s "
          f"({ours['decode'] / theirs['decode']:.2f}x) | prefill {ours['prefill']:9.1f} vs "
          f"{theirs['prefill']:9.1f} ({ours['prefill'] / theirs['prefill']:.2f}x) | peak "
          f"{ours['peak_mib']:7.1f} vs {theirs['peak_mib']:7.1f} MiB | load {ours['load_s']:.2f}"
          f" vs {theirs['load_s']:.2f} s | greedy prefix agree {same}/32 | "
          f"compute {ours['compute']}\n    rounds (prefill, decode): ferry {ours['rounds']} "
          f"mlx-lm {theirs['rounds']}", flush=True)


if __name__ == "__main__":
    main()
