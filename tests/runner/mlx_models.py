"""Created fixture models for the MLX runner tests: real `workflows.create.create` output in a
session-wide store, one model per (architecture, quant type), built on first use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from registry.names import Name
from registry.store import Store
from runner.load import load_model
from runner.quant import parse_quant_type
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateOptions, create

CreateModel = Callable[..., str]


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("runner-models")
    return Store(root)


@pytest.fixture(scope="session")
def created_model(model_store: Store, make_checkpoint) -> CreateModel:
    """`created_model(arch, quant=None, template=None)` -> the name of a created model."""
    made: dict[tuple[str, str | None, str | None], str] = {}

    def build(arch: str = "llama", quant: str | None = None, template: str | None = None) -> str:
        key = (arch, quant, template)
        if key not in made:
            name = f"test/{arch}-{quant or 'bf16'}-{len(made)}"
            options = CreateOptions(quantize=parse_quant_type(quant) if quant else None,
                                    template=template)
            create(Name.parse(name), Path(make_checkpoint(arch)), options, model_store,
                   lambda event: None, threading.Event())
            made[key] = name
        return made[key]

    return build


# A tiny llama loaded in float32 with EOS disabled, for generation tests; token ids of a prompt.
PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2]

@pytest.fixture(scope="module")
def tiny(model_store, created_model):
    loaded = load_model(model_store, created_model("llama"), "float32")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: let num_predict decide the length
    return loaded, tokenizer
