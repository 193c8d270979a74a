"""A tiny real model behind a real model server, for tests of the chat API and `ferry run`.

The model is built from a random-weight fixture checkpoint with the create workflow; its
Modelfile parameters make answers short and deterministic (greedy, 8 tokens), so a test can ask
the same question two ways and expect the same answer. The server is `ferry serve`'s app on a
loopback port; its scheduler spawns the real runner (`ferry runner`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import serve_app

MODEL = "me/tiny"
PARAMETERS = {"temperature": 0, "num_predict": 8, "seed": 7}


@dataclass(frozen=True)
class ServedModel:
    url: str
    settings: object
    model: str = MODEL


def create_tiny_model(settings: object, checkpoint: Path) -> None:
    from registry.names import Name
    from registry.store import Store
    from workflows.create import CreateOptions, create

    store = Store(settings.models_dir)  # type: ignore[attr-defined]
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse_valid(MODEL), checkpoint, CreateOptions(parameters=PARAMETERS), store,
           progress=lambda event: None, cancel=threading.Event())


@contextlib.contextmanager
def serve_tiny_model(home: Path, make_checkpoint: Callable[..., Path]) -> Iterator[ServedModel]:
    from ferry.app import build_model_server
    from ferry.config import Settings

    settings = Settings.from_env({"FERRY_HOME": str(home)})
    create_tiny_model(settings, make_checkpoint("llama", "tiny"))
    with serve_app(build_model_server(settings)) as url:
        yield ServedModel(url, settings)
