"""Gemma3ForConditionalGeneration checkpoints in both transformers layouts: the older one
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, which
arch_checkpoints writes and mlx-lm parity covers) and the newer one (transformers >= 4.52:
`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`),
made here by renaming the fixture's tensors. Each layout creates (validation included), loads and
gives the same logits and image features, plain and int8."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import mlx.core as mx
import mlx_models
import numpy as np
import pytest
from arch_checkpoints import CONFIGS, write_checkpoint
from safetensors.numpy import load_file, save_file

from registry.names import Name
from runner.load import load_model
from runner.nn.linear import Linear
from runner.quant import parse_quant_type
from workflows.create import CreateOptions, create
from workflows.create.errors import CreateError

model_store = mlx_models.model_store  # fixture
PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]
_OLDER_TO_NEWER = (("language_model.model.", "model.language_model."),
                   ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."),
                   ("multi_modal_projector.", "model.multi_modal_projector."))


def newer_layout(src: Path, out: Path, extra: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of an older-layout checkpoint with every tensor under its newer name."""
    shutil.copytree(src, out)
    tensors = {}
    for name, value in load_file(str(src / "model.safetensors")).items():
        for older, newer in _OLDER_TO_NEWER:
            if name.startswith(older):
                name = newer + name[len(older):]
                break
        else:
            raise AssertionError(f"fixture tensor {name} has no newer name")
        tensors[name] = value
    save_file({**tensors, **(extra or {})}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, make_checkpoint):
    """{(layout, tied): checkpoint dir}."""
    tokenizer = Path(make_checkpoint("llama"))
    untied = {**CONFIGS["gemma3_mm"]["text_config"], "tie_word_embeddings": False}
    dirs = {}
    for tied in (True, False):
        changes = {} if tied else {"text_config": untied}
        older = write_checkpoint(tmp_path_factory.mktemp(f"older-{tied}"), "gemma3_mm",
                                 tokenizer, **changes)
        dirs["older", tied] = older
        dirs["newer", tied] = newer_layout(older, tmp_path_factory.mktemp("n") / "ckpt")
    return dirs


def _create(store, name: str, path: Path, quant: str | None = None) -> str:
    options = CreateOptions(quantize=parse_quant_type(quant) if quant else None)
    create(Name.parse(name), path, options, store, lambda event: None, threading.Event())
    return name


def _image_features(model) -> mx.array:
    pixels = mx.random.uniform(-1, 1, (1, 16, 16, 3), key=mx.random.key(5))
    return model.encode_images(pixels)


@pytest.mark.parametrize("tied", [True, False])
def test_newer_layout_runs_as_the_older_one(model_store, layouts, tied):
    older = load_model(model_store, _create(model_store, f"test/g3-older-{tied}",
                                            layouts["older", tied]), "float32")
    newer = load_model(model_store, _create(model_store, f"test/g3-newer-{tied}",
                                            layouts["newer", tied]), "float32")
    tokens = mx.array([PROMPT])
    logits = newer.model(tokens)
    assert mx.array_equal(logits, older.model(tokens))
    assert mx.array_equal(_image_features(newer.model), _image_features(older.model))
    with_image = [*PROMPT[:3], 2047, 2047, 2047, 2047, *PROMPT[3:]]  # 4 image tokens
    features = _image_features(newer.model)
    assert mx.array_equal(newer.model(mx.array([with_image]), spans=[(3, 7)], features=features),
                          older.model(mx.array([with_image]), spans=[(3, 7)], features=features))
    if not tied:  # the head came from the newer layout's top-level lm_head.weight
        source = load_file(str(layouts["newer", tied] / "model.safetensors"))["lm_head.weight"]
        head = newer.model.language_model.lm_head.weight
        assert np.array_equal(np.array(head), source)


def test_newer_layout_int8_quantizes_the_text_half_only(model_store, layouts):
    older = load_model(model_store, _create(model_store, "test/g3-older-int8",
                                            layouts["older", False], "int8"), "native")
    newer = load_model(model_store, _create(model_store, "test/g3-newer-int8",
                                            layouts["newer", False], "int8"), "native")
    model = newer.model
    assert model.layers[0].self_attn.q_proj.bits == 8
    assert model.language_model.lm_head.bits == 8  # the top-level head, promoted to 8-bit
    fc1 = model.vision_tower.vision_model.encoder.layers[0].mlp.fc1
    assert isinstance(fc1, Linear) and fc1.weight.dtype == mx.float32
    tokens = mx.array([PROMPT])
    assert mx.array_equal(model(tokens), older.model(tokens))


def test_a_tied_model_ignores_a_stray_head(model_store, layouts, tmp_path):
    """A tied checkpoint that also stores `lm_head.weight` (the embedding, saved twice) loads:
    the runner's head is the embedding, as the config says."""
    older = layouts["older", True]
    embedding = load_file(str(older / "model.safetensors"))[
        "language_model.model.embed_tokens.weight"]
    path = newer_layout(older, tmp_path / "stray", {"lm_head.weight": embedding * 2})
    for quant in (None, "int8"):
        loaded = load_model(model_store, _create(model_store, f"test/g3-stray-{quant}", path,
                                                 quant), "float32")
        reference = load_model(model_store, _create(model_store, f"test/g3-plain-{quant}",
                                                     older, quant), "float32")
        assert "lm_head" not in loaded.model.language_model
        tokens = mx.array([PROMPT])
        assert mx.array_equal(loaded.model(tokens), reference.model(tokens))


def test_newer_layout_validation_names_the_missing_tensor(model_store, layouts, tmp_path):
    path = newer_layout(layouts["older", True], tmp_path / "short")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CreateError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        _create(model_store, "test/g3-short", path)
