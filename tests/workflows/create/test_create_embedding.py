"""Create of embedding checkpoints: encoder tensors validated against their config, the
sentence-transformers pooling files kept as layers, and the `embedding` capability alone."""

from __future__ import annotations

import json
import threading

import pytest
from safetensors.numpy import load_file, save_file

from registry.names import Name
from tests.runner.embedding_checkpoints import write_checkpoint
from workflows.create import CreateOptions, create
from workflows.create.errors import CreateError

from .helpers import read_model


def _create(store, checkpoint, name: str = "me/embed") -> None:
    create(Name.parse_valid(name), checkpoint, CreateOptions(), store,
           progress=lambda event: None, cancel=threading.Event())


@pytest.mark.parametrize(("kind", "family"), [("bert", "bert"), ("nomic_bert", "nomic_bert"),
                                              ("xlm_roberta", "xlm_roberta"),
                                              ("qwen3", "qwen3")])
def test_embedding_checkpoint_imports_with_its_pooling_files(store, tmp_path, kind, family):
    checkpoint = write_checkpoint(tmp_path / kind, kind, pooling="mean")
    _create(store, checkpoint)
    manifest, config = read_model(store, "me/embed")
    names = {layer.get("name") for layer in manifest["layers"]}
    assert {"modules.json", "1_Pooling/config.json", "tokenizer.json"} <= names
    assert config.capabilities == ["embedding"]
    assert config.model_family == family
    assert config.embedding_length == 32


def test_missing_encoder_tensor_is_named(store, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "bert", "bert")
    weights = load_file(str(checkpoint / "model.safetensors"))
    del weights["encoder.layer.1.attention.self.key.bias"]
    save_file(weights, str(checkpoint / "model.safetensors"))
    with pytest.raises(CreateError, match=r"encoder\.layer\.1\.attention\.self\.key\.bias"):
        _create(store, checkpoint)


def test_encoder_tensor_shape_must_match_config(store, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "nomic", "nomic_bert")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "n_inner": 48}))
    with pytest.raises(CreateError, match=r"fc11.weight.*shape \[64, 32\].*\[48, 32\]"):
        _create(store, checkpoint)


def test_encoder_config_without_its_sizes_is_a_clear_error(store, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "nomic", "nomic_bert")
    config = json.loads((checkpoint / "config.json").read_text())
    del config["n_embd"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CreateError, match="does not describe a NomicBertModel"):
        _create(store, checkpoint)
