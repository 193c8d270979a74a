"""By hand: ferry's Nemotron-H VL (RADIO tower + pixel shuffle + mlp1 projector + Nemotron-H)
beside mlx-vlm 0.7.10's `nemotron_h_nano_omni` on the random-weight fixture of
tests/runner/nemotron_vl_fixture.py, float32: the projected image features of the same tiles,
and the logits of a prompt carrying them (the first generated token's row included).

mlx-vlm is not a ferry dependency; unpack it beside, without its dependencies:
    python -m pip install --target /tmp/mlxvlm --no-deps mlx-vlm==0.7.10
    PYTHONPATH=$PWD:$PWD/tests/runner python -m bench.vision_parity_nemotron_mlx_vlm \
        /tmp/mlxvlm LLAMA_FIXTURE_DIR
(LLAMA_FIXTURE_DIR: any `make_checkpoint("llama")` output, for its tokenizer files.)

The tiles come from ferry's tiler (runner.media.tiling) for both: mlx-vlm's Omni processor
resizes to a patch budget instead of tiling, so only the tower, projector and language model
are compared here; tile counts are tested against the tiling rule in tests/runner.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from nemotron_vl_fixture import IMAGE_TOKENS, write_nemotron_vl_checkpoint
from PIL import Image
from safetensors.numpy import load_file

from runner.models import nemotron_h_vl


def main(mlx_vlm_dir: str, tokenizer_dir: str) -> None:
    sys.path.append(mlx_vlm_dir)
    from mlx_vlm.models.nemotron_h_nano_omni import config as vc
    from mlx_vlm.models.nemotron_h_nano_omni import nemotron_h_nano_omni as vm

    ckpt = write_nemotron_vl_checkpoint(Path(tempfile.mkdtemp()) / "c", Path(tokenizer_dir))
    config = json.loads((ckpt / "config.json").read_text())
    weights = {k: mx.array(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    ours = nemotron_h_vl.Model(nemotron_h_vl.ModelArgs.from_dict(config))
    ours.load_weights(list(nemotron_h_vl.sanitize(dict(weights)).items()), strict=True)

    theirs = vm.Model(vc.ModelConfig.from_dict(json.loads(json.dumps(config))))
    their_weights = theirs.sanitize(theirs.language_model.sanitize(dict(weights)))
    theirs.load_weights(list(their_weights.items()), strict=False)
    missing = {k for k, _ in _flat(theirs.parameters())} - set(their_weights)
    print(f"mlx-vlm parameters not in the checkpoint: {sorted(missing) or 'none'}")

    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.suffix == ".json"}
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    tiles = mx.array(ours.image_tiles(image, files))  # (tiles, H, W, 3)
    features = ours.encode_images(tiles)
    reference = theirs.extract_feature(tiles.transpose(0, 3, 1, 2))
    print(f"tiles {tiles.shape[0]}, features {tuple(features.shape)}")
    print(f"vision features  max |diff| {mx.abs(features - reference).max().item():.2e}"
          f"  (max |value| {mx.abs(reference).max().item():.2e})")

    count = features.shape[0] * features.shape[1]
    ids = mx.array([[0, 2, 379, IMAGE_TOKENS["<img>"]] + [IMAGE_TOKENS["<image>"]] * count
                    + [IMAGE_TOKENS["</img>"], 480, 203]])
    embedded = theirs.get_input_embeddings(ids, tiles.transpose(0, 3, 1, 2)).inputs_embeds
    logits = theirs.language_model(ids, inputs_embeds=embedded)
    logits = getattr(logits, "logits", logits)
    ours_logits = ours(ids, features=features)
    print(f"prompt logits    max |diff| {mx.abs(ours_logits - logits).max().item():.2e}")
    first = mx.abs(ours_logits[0, -1] - logits[0, -1]).max().item()
    print(f"first token      max |diff| {first:.2e}  (argmax ours "
          f"{mx.argmax(ours_logits[0, -1]).item()}, mlx-vlm {mx.argmax(logits[0, -1]).item()})")


def _flat(tree: object, prefix: str = "") -> list[tuple[str, object]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flat(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flat(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
