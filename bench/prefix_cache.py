#!/usr/bin/env python3
"""Benchmark: the prefix-cache trie on a hybrid model, and Nemotron-H speed beside mlx-lm's.

    .venv/bin/python bench/prefix_cache.py [--system-tokens 2000] [--turns 10]

Fixture: a random-weight Nemotron-H checkpoint (Mamba2 + attention + MLP layers, written by
tests/runner/nemotron_fixture.py), created with workflows.create and loaded as the runner loads
it (FERRY_COMPUTE's default, "auto"). In-process, no HTTP: the numbers are the runner's own
durations.

Chat: a --system-tokens system prompt, then --turns turns of a 24-token user message and a
16-token greedy answer. Per turn: time to first token (prefill + first token) with the trie and
with a cold prefill of the same prompt (a generator whose cache budget is 0), their ratio, and
the bytes the trie holds after the turn (--budget caps them). Target: turns 2.. at most 0.2x cold.
Speed: prefill tok/s over the system prompt and decode tok/s over --gen-tokens, ferry beside
mlx-lm (its default: the checkpoint's bf16) on the same checkpoint, and the process CPU time
per decoded token (all threads: BLAS's included), the figure a loaded machine disturbs least.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "runner"))
SHARED = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"  # worktrees
MAKE_CHECKPOINT = SHARED / "fixtures" / "make_checkpoint.py"

BENCH_CONFIG = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, mamba_num_heads=16, mamba_head_dim=32,
                    n_groups=4, ssm_state_size=64, hybrid_override_pattern="M-M*-M-M*-M-",
                    max_position_embeddings=8192)  # 10 turns past 2,000 tokens: no truncation


def fixture(workdir: Path) -> Path:
    from nemotron_fixture import write_nemotron_checkpoint

    llama = workdir / "llama-tiny"
    if not (llama / "config.json").is_file():
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(llama), "--preset",
                        "tiny", "--force"], check=True, stdout=subprocess.DEVNULL)
    return write_nemotron_checkpoint(workdir / "nemotron", llama, **BENCH_CONFIG)


def loaded_model(workdir: Path, checkpoint: Path):
    from registry.names import Name
    from registry.store import Store
    from runner.load import load_model
    from runner.tokenizer import ModelTokenizer
    from workflows.create import CreateOptions, create

    store = Store(workdir / "store")
    create(Name.parse("bench/nemotron"), checkpoint, CreateOptions(), store, lambda e: None,
           threading.Event())
    loaded = load_model(store, "bench/nemotron", "auto")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()
    return loaded, tokenizer


def generator(loaded, tokenizer, budget: int):
    from runner.generate import Generator
    from runner.prefix_cache import PrefixCache

    return Generator(loaded.model, tokenizer, loaded.context_length,
                     prefix_cache=PrefixCache(budget))


def run(gen, prompt: list[int], num_predict: int):
    from runner.sample import Options

    *_, done = gen.generate(prompt, Options(temperature=0, num_predict=num_predict))
    return done, gen.tokens


def chat(loaded, tokenizer, args) -> None:
    rng = random.Random(0)
    words = lambda n: [rng.randrange(5, 2048) for _ in range(n)]  # noqa: E731
    warm, cold = generator(loaded, tokenizer, args.budget), generator(loaded, tokenizer, 0)
    prompt = words(args.system_tokens)
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'trie ms':>8} {'cold ms':>8} "
          f"{'ratio':>6} {'bytes':>10}")
    for turn in range(1, args.turns + 1):
        prompt = prompt + words(24)
        done, answer = run(warm, prompt, 16)
        cold_done, _ = run(cold, prompt, 1)
        trie_ms, cold_ms = done.prompt_eval_duration / 1e6, cold_done.prompt_eval_duration / 1e6
        print(f"{turn:>4} {len(prompt):>7} {done.prompt_cached:>7} {trie_ms:>8.1f} "
              f"{cold_ms:>8.1f} {trie_ms / cold_ms:>6.2f} {warm.prefix_cache.nbytes:>10}")
        prompt = prompt + answer


def speed(loaded, tokenizer, checkpoint: Path, args) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from runner.sample import Options

    prompt = [random.Random(1).randrange(5, 2048) for _ in range(args.system_tokens)]
    pieces = generator(loaded, tokenizer, 0).generate(
        prompt, Options(temperature=0, num_predict=args.gen_tokens))
    next(pieces)  # the first token: decode starts here
    cpu_first = time.process_time()
    *_, done = pieces
    cpu = (time.process_time() - cpu_first) / max(1, done.eval_count - 1)
    ours = (len(prompt) / done.prompt_eval_duration * 1e9, done.eval_count / done.eval_duration
            * 1e9, cpu * 1e3)
    model, _ = mlx_lm.load(str(checkpoint))
    started = time.perf_counter()
    steps = generate_step(mx.array(prompt), model, max_tokens=args.gen_tokens)
    next(steps)
    first, cpu_first = time.perf_counter(), time.process_time()
    count = 1 + sum(1 for _ in steps)
    ended = time.perf_counter()
    cpu = (time.process_time() - cpu_first) / max(1, count - 1)
    theirs = (len(prompt) / (first - started), (count - 1) / (ended - first), cpu * 1e3)
    print(f"\n{'':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode CPU ms/tok':>18}"
          f"   (compute {loaded.compute})")
    print(f"{'ferry':>8} {ours[0]:>14.0f} {ours[1]:>13.1f} {ours[2]:>18.1f}")
    print(f"{'mlx-lm':>8} {theirs[0]:>14.0f} {theirs[1]:>13.1f} {theirs[2]:>18.1f}")
    print(f"{'ratio':>8} {ours[0] / theirs[0]:>14.2f} {ours[1] / theirs[1]:>13.2f} "
          f"{theirs[2] / ours[2]:>18.2f}")


def preload_openblas() -> None:
    """Re-exec with OpenBLAS preloaded, as `ferry runner` does: float32 GEMMs on the CPU."""
    from ferry.commands.runner import OPENBLAS

    preload = os.environ.get("LD_PRELOAD", "")
    if OPENBLAS.is_file() and str(OPENBLAS) not in preload.split(":"):
        env = {**os.environ, "LD_PRELOAD": f"{OPENBLAS}:{preload}" if preload else str(OPENBLAS)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    preload_openblas()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64 << 20)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--only", choices=["chat", "speed"], default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ferry-bench-prefix-"))
    checkpoint = fixture(workdir)
    loaded, tokenizer = loaded_model(workdir, checkpoint)
    if args.only != "speed":
        chat(loaded, tokenizer, args)
    if args.only != "chat":
        speed(loaded, tokenizer, checkpoint, args)


if __name__ == "__main__":
    main()
