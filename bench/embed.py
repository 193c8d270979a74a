#!/usr/bin/env python3
"""Benchmark: embeddings per second through /api/embed, batched versus one request per input.

    .venv/bin/python bench/embed.py [--texts 64] [--repeat 3] [--layers 6] [--hidden 384]

A random-weight BERT of MiniLM's shape (6 layers, hidden 384, 12 heads; the fixture's small
WordPiece vocabulary) is imported with the create workflow into a temporary FERRY_HOME and
served by the real model server and runner on loopback. After a warm-up (model loaded), the
same `--texts` sentences (8-24 words each) are embedded (a) in one /api/embed request, (b) in
requests of 8, and (c) one request per sentence, each `--repeat` times; the best wall time of
each is kept. Prints embeddings per second and the speed-up of batching per input.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import serve_app  # noqa: E402

from tests.runner.embedding_checkpoints import WORDS, write_checkpoint  # noqa: E402


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(8, 24))) for _ in range(count)]


def create_model(home: Path, layers: int, hidden: int) -> None:
    from registry.names import Name
    from registry.store import Store
    from workflows.create import CreateOptions, create

    sizes = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": 12,
             "intermediate_size": 4 * hidden, "max_position_embeddings": 512}
    checkpoint = write_checkpoint(home / "ckpt", "bert", pooling="mean", sizes=sizes)
    store = Store(home / "models")
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse_valid("bench/embed"), checkpoint, CreateOptions(), store,
           progress=lambda event: None, cancel=threading.Event())


def best_seconds(url: str, batches: list[list[str]], repeat: int) -> float:
    best = float("inf")
    with httpx.Client(timeout=600) as client:
        for _ in range(repeat):
            started = time.perf_counter()
            for batch in batches:
                response = client.post(f"{url}/api/embed",
                                       json={"model": "bench/embed", "input": batch})
                response.raise_for_status()
                assert len(response.json()["embeddings"]) == len(batch)
            best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    args = parser.parse_args()
    from ferry.app import build_model_server
    from ferry.config import Settings

    texts = sentences(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        create_model(home, args.layers, args.hidden)
        settings = Settings.from_env({"FERRY_HOME": str(home), "FERRY_MODELS":
                                      str(home / "models")})
        with serve_app(build_model_server(settings)) as url:
            best_seconds(url, [texts[:8]], 1)  # load the model, warm the kernels
            plans = {"one request": [texts],
                     "batches of 8": [texts[i:i + 8] for i in range(0, len(texts), 8)],
                     "one by one": [[t] for t in texts]}
            rates = {name: len(texts) / best_seconds(url, batches, args.repeat)
                     for name, batches in plans.items()}
            running = httpx.get(f"{url}/api/ps").json()["models"]
    compute = running[0]["compute"] if running else "?"
    print(f"{args.texts} texts, BERT {args.layers}x{args.hidden}, best of {args.repeat}, "
          f"runner compute {compute}")
    for name, rate in rates.items():
        print(f"  {name:<14} {rate:8.1f} embeddings/s")
    speedup = rates["one request"] / rates["one by one"]
    print(f"  batched vs one by one: {speedup:.1f}x per input (target >= 3x)")
    return 0 if speedup >= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
