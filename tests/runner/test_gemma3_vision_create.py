"""create on a Gemma 3 vision checkpoint: the tower and projector stay at source precision under
int8, `capabilities` says vision exactly when the runner encodes the architecture's images, and
the created model loads and encodes an image."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import mlx_models
import numpy as np
import pytest
from arch_checkpoints import write_checkpoint
from PIL import Image

from registry.manifests import ModelConfig
from registry.names import Name
from runner.load import load_model
from runner.media.decode import decode_image
from runner.media.preprocess import ProcessorConfig, pixel_values
from runner.nn.linear import Linear
from runner.quant import parse_quant_type
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, make_checkpoint):
    def build(arch: str, **changes) -> Path:
        out = tmp_path_factory.mktemp(f"vision-{arch}")
        return write_checkpoint(out, arch, Path(make_checkpoint("llama")), **changes)
    return build


def _create(store, name: str, path: Path, quant: str | None = None) -> list[str]:
    options = CreateOptions(quantize=parse_quant_type(quant) if quant else None)
    create(Name.parse(name), path, options, store, lambda event: None, threading.Event())
    manifest = store.get_model(Name.parse(name)).manifest()
    assert manifest.config is not None
    return list(ModelConfig.from_json(store.read_blob(manifest.config.digest)).capabilities or [])


def test_int8_keeps_the_vision_tower_at_source_precision(model_store, checkpoint, tmp_path):
    caps = _create(model_store, "test/gemma3-vision-int8", checkpoint("gemma3_mm"), "int8")
    assert "vision" in caps
    loaded = load_model(model_store, "test/gemma3-vision-int8", "native")
    model = loaded.model
    assert model.layers[0].self_attn.q_proj.bits == 8
    fc1 = model.vision_tower.vision_model.encoder.layers[0].mlp.fc1
    assert isinstance(fc1, Linear) and fc1.weight.dtype == mx.float32
    assert model.multi_modal_projector.mm_input_projection_weight.dtype == mx.float32
    image = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    png = tmp_path / "a.png"
    Image.fromarray(image).save(png)
    config = ProcessorConfig.from_files(loaded.files.files, model.args.vision.image_size)
    pixels = mx.array(pixel_values(decode_image(png.read_bytes()), config)[None])
    features = model.encode_images(pixels)
    assert features.shape == (1, 4, 128) and bool(mx.isfinite(features).all())


def test_text_only_gemma3_has_no_vision(model_store, checkpoint):
    assert "vision" not in _create(model_store, "test/gemma3-text", checkpoint("gemma3"))


def test_vision_config_on_an_unsupported_architecture_is_not_advertised(model_store,
                                                                         checkpoint):
    path = checkpoint("llama", vision_config={"hidden_size": 16},
                      audio_config={"hidden_size": 8})
    caps = _create(model_store, "test/llama-with-towers", path)
    assert "vision" not in caps and "audio" not in caps
