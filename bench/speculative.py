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
MTP: the Nemotron-H fixture of tests/runner/nemotron_fixture.py (7 hybrid layers, hidden 128,
tied embeddings scaled up so the target often repeats a token) with its inline MTP head
(attention + 8-expert MoE): "echo" (passes the target's hidden through: right where the target
repeats) and "random" (almost never right: parked after a few rounds), against plain decode of
the same model, --rounds times each, alternating.

    .venv/bin/python bench/speculative.py --rows mtp --gen-tokens 128 --rounds 3
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
SHARED = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"  # worktrees
MAKE_CHECKPOINT = SHARED / "fixtures" / "make_checkpoint.py"


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


MTP_PRESETS = {  # nemotron_fixture overrides; "tiny" is the test fixture itself
    "tiny": {"embed_scale": 4.0},
    "medium": {"embed_scale": 12.0, "hidden_size": 768, "intermediate_size": 3072,
               "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
               "mamba_num_heads": 24, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 4,
               "moe_intermediate_size": 384, "moe_shared_expert_intermediate_size": 768},
}


def mtp_rows(workdir: Path, gen: int, rounds: int, preset: str) -> None:
    from registry.names import Name
    from registry.store import Store
    from runner.generate import Generator
    from runner.load import load_model
    from runner.tokenizer import ModelTokenizer
    from workflows.create import CreateOptions, create

    sys.path.insert(0, str(REPO / "tests" / "runner"))
    from nemotron_fixture import write_nemotron_checkpoint

    tokenizer_dir = checkpoint(workdir, "tiny", 0)
    store = Store(workdir / "mtp-store")
    prompt = prompt_tokens(64)
    print(f"\nMTP decode, nemotron_h fixture ({preset}), {gen} greedy tokens, {rounds} rounds "
          "(median t/s)")
    print(f"{'head':<10}{'plain t/s':>11}{'MTP t/s':>10}{'speedup':>9}{'accepted':>12}"
          f"{'rate':>7}{'same':>6}")
    for head in ("echo", "random"):
        name = f"bench/nemotron-mtp-{preset}-{head}"
        source = workdir / f"nemotron-mtp-{preset}-{head}"
        if not (source / "config.json").is_file():
            write_nemotron_checkpoint(source, tokenizer_dir, mtp=head, tie_word_embeddings=True,
                                      **MTP_PRESETS[preset])
        try:
            store.get_model(Name.parse_valid(name))
        except Exception:
            create(Name.parse(name), source, CreateOptions(), store, lambda e: None,
                   threading.Event())
        loaded = load_model(store, name, "float32")
        tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
        tokenizer.eos_ids.clear()
        rates: dict[bool, list[float]] = {False: [], True: []}
        texts, stats = {}, None
        for _ in range(rounds):
            for drafting in (False, True):
                generator = Generator(loaded.model, tokenizer, loaded.context_length)
                generator.drafting = generator.drafting and drafting
                run(generator, prompt[:8], 8)  # warm-up (compiles the decode graph)
                generator.prefix_cache.clear()
                texts[drafting], done = run(generator, prompt, gen)
                rates[drafting].append(done.eval_count / done.eval_duration * 1e9)
                stats = done.draft if drafting else stats
        plain, mtp = (sorted(rates[d])[len(rates[d]) // 2] for d in (False, True))
        assert stats is not None
        accepted = f"{stats.accepted}/{stats.proposed}"
        rate = stats.accepted / max(stats.proposed, 1)
        print(f"{head:<10}{plain:>11.1f}{mtp:>10.1f}{mtp / plain:>8.2f}x{accepted:>12}"
              f"{rate:>7.0%}{'yes' if texts[True] == texts[False] else 'NO':>6}")


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
    parser.add_argument("--rows", choices=("all", "draft", "prefix", "mtp"), default="all")
    parser.add_argument("--rounds", type=int, default=3, help="MTP rows: runs of each")
    parser.add_argument("--mtp-preset", choices=tuple(MTP_PRESETS), default="tiny")
    args = parser.parse_args()
    from registry.store import Store

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = Store(workdir / "store")
    started = time.perf_counter()
    if args.rows in ("all", "draft"):
        decode_rows(store, workdir, args.preset, args.gen_tokens)
    if args.rows in ("all", "prefix"):
        prefix_rows(store, workdir, args.preset, args.prompt_tokens)
    if args.rows in ("all", "mtp"):
        mtp_rows(workdir, args.gen_tokens, args.rounds, args.mtp_preset)
    print(f"\n({time.perf_counter() - started:.0f}s)")


if __name__ == "__main__":
    main()
