#!/usr/bin/env python3
"""Benchmark: decode speed with a JSON-schema grammar (llguidance masks) versus without.

    .venv/bin/python bench/constrained.py [--preset small] [--tokens 128] [--repeat 3]

Builds a random-weight fixture checkpoint, creates it into a temp store, loads it with ferry's
runner and decodes `--tokens` tokens greedily from the same prompt, EOS disabled: once plain
(the pipelined loop), once under a schema whose string field never closes on its own (so the
grammar stays active for every token). Runs alternate, `--repeat` times each, and the best of
each is kept (the machine may be shared). Prints tok/s for both, the slowdown, and the grammar's
own cost per token (mask computation measured apart).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"  # worktrees
MAKE_CHECKPOINT = SHARED / "fixtures" / "make_checkpoint.py"
SCHEMA = {"type": "object", "properties": {"notes": {"type": "string"}}, "required": ["notes"]}


def load(preset: str, tmp: Path):
    from registry.names import Name
    from registry.store import Store
    from runner.load import load_model
    from runner.tokenizer import ModelTokenizer
    from workflows.create import CreateOptions, create

    checkpoint = tmp / "ckpt"
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), "--out", str(checkpoint), "--preset",
                    preset, "--force"], check=True, capture_output=True)
    store = Store(tmp / "store")
    store.root.mkdir(parents=True)
    create(Name.parse_valid("bench/model"), checkpoint, CreateOptions(), store,
           lambda event: None, threading.Event())
    loaded = load_model(store, "bench/model", "auto")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # decode exactly --tokens tokens
    return loaded, tokenizer


def timed(generator, prompt, options, constraint=None) -> float:
    started = time.perf_counter()
    out = list(generator.generate(prompt, options, constraint=constraint))
    elapsed = time.perf_counter() - started
    return out[-1].eval_count / elapsed


def mask_cost(compiler, tokens: int) -> float:
    """Seconds per token the grammar alone takes (mask + consume), on a string that never ends."""
    constraint = compiler.constraint(SCHEMA)
    tok = compiler.tokenizer
    steps = [*tok.encode('{"notes": "'), *tok.encode("a" * tokens)][:tokens]
    started = time.perf_counter()
    for token in steps:
        constraint.allowed(tok.vocab_size)
        constraint.accept(token)
    return (time.perf_counter() - started) / len(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from runner.constrain import GrammarCompiler
    from runner.generate import Generator
    from runner.sample import Options

    with tempfile.TemporaryDirectory() as tmp:
        loaded, tokenizer = load(args.preset, Path(tmp))
        generator = Generator(loaded.model, tokenizer, loaded.context_length)
        compiler = GrammarCompiler(tokenizer)
        prompt = tokenizer.encode(tokenizer.render([{"role": "user", "content": "notes?"}]))
        options = Options(temperature=0, num_predict=args.tokens)
        compiler.constraint(SCHEMA)  # the vocabulary conversion happens once per model
        timed(generator, prompt, options)  # warm-up
        plain, constrained = [], []
        for _ in range(args.repeat):
            plain.append(timed(generator, prompt, options))
            constrained.append(timed(generator, prompt, options, compiler.constraint(SCHEMA)))
        per_token = mask_cost(compiler, args.tokens)
    best_plain, best_constrained = max(plain), max(constrained)
    print(f"preset {args.preset}, {args.tokens} tokens, best of {args.repeat}")
    print(f"  plain decode        {best_plain:8.1f} tok/s")
    print(f"  with JSON schema    {best_constrained:8.1f} tok/s "
          f"({100 * (1 - best_constrained / best_plain):+.1f}% slower)")
    print(f"  grammar alone       {per_token * 1e3:8.3f} ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
