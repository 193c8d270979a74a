#!/usr/bin/env python3
"""Benchmark: decode with and without a draft model; a chat's second turn with and without the
prefix cache. In-process (runner.generate.Generator on a model created by workflows.create), so
the numbers are the runner's own prompt_eval/eval durations, no HTTP.

    .venv/bin/python bench/speculative.py [--preset tiny] [--gen-tokens 256]

Drafts: the target's own checkpoint (every proposal accepted: the upper bound of what
speculation can save for this draft cost) and a checkpoint of another seed (same shapes, other
weights: most proposals rejected, the lower bound). A draft as large as its target cannot make
decode faster; the rows show the round overhead and the acceptance. Greedy, so the draft rows
must print the same text as the plain row ("same" column).
Prefix cache: turn 1 is a --prompt-tokens prompt plus 32 generated tokens; turn 2 adds 16 new
tokens; its prefill is timed on the warm generator and on a cold one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MAKE_CHECKPOINT = REPO.parent / "shared" / "fixtures" / "make_checkpoint.py"


def checkpoint(workdir: Path, preset: str, seed: int) -> Path:
    out = workdir / f"llama-{preset}-seed{seed}"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(out), "--arch",
                        "llama", "--preset", preset, "--seed", str(seed), "--force"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def created(store, workdir: Path, preset: str, draft_seed: int | None) -> str:
    from registry.errors import NotFound
    from registry.names import Name
    from workflows.create import CreateOptions, create

    name = f"bench/spec-{preset}:draft{draft_seed}"
    try:
        store.get_model(Name.parse_valid(name))
    except NotFound:
        draft = checkpoint(workdir, preset, draft_seed) if draft_seed is not None else None
        create(Name.parse(name), checkpoint(workdir, preset, 0), CreateOptions(draft_dir=draft),
               store, lambda e: None, threading.Event())
    return name


def generator_for(store, name: str, use_draft: bool, prefix_cache=None):
    from runner.generate import Generator
    from runner.load import load_model
    from runner.tokenizer import ModelTokenizer

    loaded = load_model(store, name, "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: run the whole budget
    return Generator(loaded.model, tokenizer, loaded.context_length,
                     draft=loaded.draft if use_draft else None, prefix_cache=prefix_cache)


def run(generator, prompt: list[int], gen: int):
    from runner.sample import Options

    pieces = list(generator.generate(prompt, Options(temperature=0, num_predict=gen)))
    return "".join(pieces[:-1]), pieces[-1]


def prompt_tokens(n: int) -> list[int]:
    return [(i * 7919) % 2000 + 8 for i in range(n)]


def decode_rows(store, workdir: Path, preset: str, gen: int) -> None:
    prompt = prompt_tokens(64)
    print(f"\ndecode, {preset}, {gen} greedy tokens")
    print(f"{'draft':<22}{'decode t/s':>12}{'accepted':>12}{'same':>6}")
    baseline = None
    for label, seed, use in (("none", None, False), ("itself (seed 0)", 0, True),
                             ("other seed (1)", 1, True)):
        generator = generator_for(store, created(store, workdir, preset, seed), use)
        run(generator, prompt[:8], 8)  # warm-up
        generator.prefix_cache.clear()
        text, done = run(generator, prompt, gen)
        baseline = text if baseline is None else baseline
        rate = done.eval_count / done.eval_duration * 1e9
        stats = done.draft
        accepted = f"{stats.accepted}/{stats.proposed}" if stats else "-"
        print(f"{label:<22}{rate:>12.1f}{accepted:>12}{'yes' if text == baseline else 'NO':>6}")


def prefix_rows(store, workdir: Path, preset: str, n_prompt: int) -> None:
    from runner.prefix_cache import PrefixCache

    name = created(store, workdir, preset, None)
    print(f"\nsecond-turn prefill, {preset}, turn 1 = {n_prompt} prompt + 32 generated tokens")
    print(f"{'prefix cache':<14}{'evaluated':>10}{'cached':>8}{'prefill ms':>12}")
    for label, budget in (("on", 1 << 30), ("off", 0)):
        generator = generator_for(store, name, False, PrefixCache(budget))
        run(generator, prompt_tokens(16), 4)  # warm-up
        first = prompt_tokens(n_prompt)
        run(generator, first, 32)
        second = first + generator.tokens + prompt_tokens(16)
        _, done = run(generator, second, 8)
        print(f"{label:<14}{done.prompt_eval_count:>10}{done.prompt_cached:>8}"
              f"{done.prompt_eval_duration / 1e6:>12.1f}")


def preload_openblas() -> None:
    """Re-exec with OpenBLAS preloaded, as `ferry runner` does: float32 GEMMs on the CPU."""
    from ferry.commands.runner import OPENBLAS

    preload = os.environ.get("LD_PRELOAD", "")
    if OPENBLAS.is_file() and str(OPENBLAS) not in preload.split(":"):
        env = {**os.environ, "LD_PRELOAD": f"{OPENBLAS}:{preload}" if preload else str(OPENBLAS)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    preload_openblas()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--workdir", default="/tmp/ferry-bench-spec")
    args = parser.parse_args()
    from registry.store import Store

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = Store(workdir / "store")
    started = time.perf_counter()
    decode_rows(store, workdir, args.preset, args.gen_tokens)
    prefix_rows(store, workdir, args.preset, args.prompt_tokens)
    print(f"\n({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
