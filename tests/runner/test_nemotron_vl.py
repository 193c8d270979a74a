"""Nemotron-H VL (runner/models/nemotron_h_vl.py, _radio.py, runner/media/tiling.py): tile and
placeholder counts against the tiling rule computed independently here, the pixel shuffle and
the position-embedding resize against their definitions, create (vision advertised, towers at
source precision, audio kept and refused), and an image through /api/chat on a real server."""

from __future__ import annotations

import base64
import io
import json
import threading
from fractions import Fraction
from pathlib import Path

import httpx
import mlx.core as mx
import mlx_models
import numpy as np
import pytest
from conftest import serve_app
from nemotron_vl_fixture import IMAGE_TOKENS, write_nemotron_vl_checkpoint
from PIL import Image

from registry.manifests import ModelConfig
from registry.names import Name
from runner.load import load_model
from runner.media.assemble import assemble, bind, key_images
from runner.media.decode import MediaError, decode_image
from runner.media.prompt import IMAGE_KEY_BASE, MARKER, ImageSlots
from runner.media.tiling import TilingConfig, tile_count
from runner.models import _radio as radio
from runner.models import nemotron_h_vl
from runner.nn.linear import Linear
from runner.quant import parse_quant_type
from workflows.create import CreateOptions, create

model_store = mlx_models.model_store  # fixture
TILING = TilingConfig(tile=16, max_tiles=12, thumbnail=True)
TOKENS_PER_TILE = 4  # (16 / 4)^2 patches, 2x2 folded by the pixel shuffle


def _reference_tiles(width: int, height: int, tile: int = 16, max_tiles: int = 12) -> int:
    """The tiling rule, written out independently: the grids of at most `max_tiles` whose
    column/row ratio is nearest the image's (exact fractions); among equally near ones the
    processor walks fewest tiles first and moves to a larger grid only when the image has
    more than half that grid's pixels; a thumbnail follows any multi-tile grid."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if c * r <= max_tiles]
    aspect = Fraction(width, height)
    best = min(abs(aspect - Fraction(c, r)) for c, r in grids)
    nearest = sorted((c * r for c, r in grids if abs(aspect - Fraction(c, r)) == best))
    larger = [n for n in nearest[1:] if width * height > tile * tile * n / 2]
    n = larger[-1] if larger else nearest[0]
    return n + (1 if n > 1 else 0)


# (width, height, tiles) worked by hand from the rule, 16-pixel tiles, at most 12
HAND = [(16, 16, 1),    # square, small: 1x1
        (32, 16, 3),    # 2:1 -> 2x1 (4x2 would need > 1024 px), + thumbnail
        (64, 32, 9),    # 2:1, 2048 px > half of 4x2's 4096 -> 4x2, + thumbnail
        (48, 32, 7),    # 3:2 -> 3x2, + thumbnail
        (640, 480, 13),  # 4:3 -> 4x3, + thumbnail
        (100, 10, 11),  # 10:1 -> 10x1, + thumbnail
        (10, 100, 11),  # 1:10 -> 1x10, + thumbnail
        (17, 13, 13)]   # 1.31 is nearest 4:3 among the grids of at most 12


@pytest.mark.parametrize(("width", "height", "tiles"), HAND)
def test_tile_counts_follow_the_tiling_rule(width: int, height: int, tiles: int) -> None:
    assert _reference_tiles(width, height) == tiles
    assert tile_count(width, height, TILING) == tiles


def test_tile_counts_match_the_rule_over_many_sizes() -> None:
    rng = np.random.default_rng(0)
    for width, height in rng.integers(1, 4000, (300, 2)):
        assert tile_count(int(width), int(height), TILING) == _reference_tiles(width, height)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, make_checkpoint) -> Path:
    return write_nemotron_vl_checkpoint(tmp_path_factory.mktemp("nemotron-vl"),
                                        Path(make_checkpoint("llama")))


@pytest.fixture(scope="module")
def model(checkpoint):
    from safetensors.numpy import load_file
    config = json.loads((checkpoint / "config.json").read_text())
    built = nemotron_h_vl.Model(nemotron_h_vl.ModelArgs.from_dict(config))
    weights = {k: mx.array(v) for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    built.load_weights(list(nemotron_h_vl.sanitize(weights).items()), strict=True)
    return built


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.suffix == ".json"}


def _key(request) -> None:
    """Key the image runs as the runner's worker does before generating."""
    key_images(request, request.tokens, ImageSlots(), lambda: None)


def _png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(("width", "height", "tiles"), HAND[:5])
def test_each_image_expands_to_its_tiles_tokens_between_img_tags(model, checkpoint, width,
                                                                 height, tiles) -> None:
    request = assemble(model, _files(checkpoint), [0, 7, MARKER, 9, MARKER, 11],
                       [_png(width, height), _png(20, 20, 1)])
    _key(request)
    count = tiles * TOKENS_PER_TILE
    first, second = request.spans
    assert first[1] - first[0] == count and second[1] - second[0] == TOKENS_PER_TILE
    ids = request.tokens
    assert ids[first[0] - 1] == IMAGE_TOKENS["<img>"] and ids[first[1]] == IMAGE_TOKENS["</img>"]
    assert ids[:2] == [0, 7] and ids[-1] == 11 and ids[first[1] + 1] == 9
    assert all(t >= IMAGE_KEY_BASE for a, b in request.spans for t in ids[a:b])
    assert [len(p) for p in request.pixels] == [tiles, 1]


def test_bound_image_rows_give_the_logits_of_the_features(model, checkpoint) -> None:
    """The runner's path (keys, chunked tower, bound rows) equals one forward over features."""
    request = assemble(model, _files(checkpoint), [0, MARKER, 9], [_png(48, 32)])
    _key(request)
    bind(model, request)
    keyed = model(mx.array([request.tokens]))
    features = model.encode_images(mx.array(np.concatenate(request.pixels)))
    plain = [IMAGE_TOKENS["<image>"] if t >= IMAGE_KEY_BASE else t for t in request.tokens]
    direct = model(mx.array([plain]), features=features)
    assert mx.abs(keyed - direct).max().item() < 1e-4


def _shuffle_reference(x: np.ndarray, v1: bool) -> np.ndarray:
    """Each 2x2 block (rows 2i, 2i+1; columns 2j, 2j+1) -> one vector, in the order
    (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1); v1 stores the grid transposed."""
    _, rows, cols, _ = x.shape
    out = np.stack([np.stack([np.concatenate([x[:, 2 * i, 2 * j], x[:, 2 * i, 2 * j + 1],
                                              x[:, 2 * i + 1, 2 * j], x[:, 2 * i + 1, 2 * j + 1]],
                                             axis=-1)
                              for j in range(cols // 2)], axis=1)
                    for i in range(rows // 2)], axis=1)
    return out.transpose(0, 2, 1, 3) if v1 else out


@pytest.mark.parametrize("v1", [False, True])
def test_pixel_shuffle_folds_2x2_blocks(v1: bool) -> None:
    x = np.random.default_rng(2).standard_normal((2, 4, 6, 3)).astype(np.float32)
    ours = np.array(nemotron_h_vl.pixel_shuffle(mx.array(x), 2, v1))
    np.testing.assert_array_equal(ours, _shuffle_reference(x, v1))


def _bilinear_reference(grid: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """F.interpolate(mode="bilinear", align_corners=False), one output pixel at a time."""
    height, width, _ = grid.shape
    out = np.zeros((rows, cols, grid.shape[2]))
    for i in range(rows):
        for j in range(cols):
            y = max((i + 0.5) * height / rows - 0.5, 0.0)
            x = max((j + 0.5) * width / cols - 0.5, 0.0)
            y0, x0 = min(int(y), height - 1), min(int(x), width - 1)
            y1, x1 = min(y0 + 1, height - 1), min(x0 + 1, width - 1)
            dy, dx = y - y0, x - x0
            out[i, j] = ((1 - dy) * ((1 - dx) * grid[y0, x0] + dx * grid[y0, x1])
                         + dy * ((1 - dx) * grid[y1, x0] + dx * grid[y1, x1]))
    return out


@pytest.mark.parametrize(("rows", "cols"), [(4, 4), (6, 3), (16, 16), (20, 7)])
def test_position_grid_resizes_as_pytorch_bilinear(rows: int, cols: int) -> None:
    grid = np.random.default_rng(3).standard_normal((16, 16, 5)).astype(np.float32)
    ours = np.array(radio.resize_bilinear(mx.array(grid), rows, cols))
    np.testing.assert_allclose(ours, _bilinear_reference(grid.astype(np.float64), rows, cols),
                               atol=1e-5)


def _create(store, name: str, path: Path, quant: str | None = None) -> list[str]:
    options = CreateOptions(quantize=parse_quant_type(quant) if quant else None)
    create(Name.parse(name), path, options, store, lambda event: None, threading.Event())
    manifest = store.get_model(Name.parse(name)).manifest()
    assert manifest.config is not None
    return list(ModelConfig.from_json(store.read_blob(manifest.config.digest)).capabilities or [])


def test_int8_keeps_radio_and_the_projector_at_source_precision(model_store, checkpoint):
    caps = _create(model_store, "test/nemotron-vl-int8", checkpoint, "int8")
    assert "vision" in caps and "audio" not in caps
    loaded = load_model(model_store, "test/nemotron-vl-int8", "native")
    model = loaded.model
    assert model.layers[1].mixer.q_proj.bits == 8  # the language model's attention
    fc1 = model.vision_model.radio_model.model.blocks[0].mlp.fc1
    assert isinstance(fc1, Linear) and fc1.weight.dtype == mx.float32
    assert isinstance(model.mlp1[1], Linear) and model.mlp1[1].weight.dtype == mx.float32
    request = assemble(model, loaded.files.files, [0, MARKER, 9], [_png(30, 20)])
    _key(request)
    bind(model, request)
    assert bool(mx.isfinite(model(mx.array([request.tokens]))).all())


def test_audio_tower_is_kept_but_audio_is_refused(model_store, checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file
    with_audio = tmp_path / "omni"
    shutil.copytree(checkpoint, with_audio)
    tensors = load_file(str(with_audio / "model.safetensors"))
    tensors["sound_encoder.encoder.layers.0.weight"] = np.ones((8, 8), np.float32)
    save_file(tensors, str(with_audio / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((with_audio / "config.json").read_text())
    (with_audio / "config.json").write_text(json.dumps({**config,
                                                        "sound_config": {"hidden_size": 8}}))
    caps = _create(model_store, "test/nemotron-vl-audio", with_audio)
    assert "vision" in caps and "audio" not in caps
    loaded = load_model(model_store, "test/nemotron-vl-audio", "native")
    assert "sound_encoder" not in loaded.model
    wav = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(32)
    with pytest.raises(MediaError, match="audio input is not supported"):
        decode_image(wav)


def test_an_image_through_api_chat_answers(tmp_path, checkpoint):
    from ferry.app import build_model_server
    from ferry.config import Settings
    from registry.store import Store

    settings = Settings.from_env({"FERRY_HOME": str(tmp_path)})
    store = Store(settings.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    create(Name.parse_valid("vis/nemotron"), checkpoint,
           CreateOptions(parameters={"temperature": 0, "num_predict": 4}), store,
           progress=lambda event: None, cancel=threading.Event())
    image = base64.b64encode(_png(40, 24)).decode()
    body = {"model": "vis/nemotron", "stream": False,
            "messages": [{"role": "user", "content": "what is this", "images": [image]}]}
    with serve_app(build_model_server(settings)) as url:
        response = httpx.post(f"{url}/api/chat", json=body, timeout=300)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["done"] and answer["eval_count"] > 0
        assert isinstance(answer["message"]["content"], str)
