"""By hand: ferry's Gemma 3 vision features and causal logits beside mlx-vlm 0.7.10's on the
random-weight `gemma3_mm` fixture (tests/runner/arch_checkpoints.py), float32.

mlx-vlm is not a ferry dependency (it pulls datasets, pandas, opencv, mlx-audio); install it
beside, without its dependencies:
    python -m pip install --target /tmp/mlxvlm --no-deps mlx-vlm==0.7.10
    PYTHONPATH=$PWD python -m bench.vision_parity_mlx_vlm /tmp/mlxvlm LLAMA_FIXTURE_DIR
(LLAMA_FIXTURE_DIR: any `make_checkpoint("llama")` output, for its tokenizer files.)

Two mlx-vlm departures are neutralised so the rest can be compared: it divides image features by
sqrt of the *top-level* `hidden_size` (default 2048, absent from Gemma 3 configs), and it zeroes
the embeddings of `pad_token_id` (0, the fixture's BOS). It attends causally over the image
tokens; ferry follows transformers (both ways), tested in tests/runner/test_gemma3_vision.py, so
the comparison here runs ferry without spans.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file

from runner.models import gemma3
from tests.runner.arch_checkpoints import write_checkpoint


def main(mlx_vlm_dir: str, tokenizer_dir: str) -> None:
    sys.path.append(mlx_vlm_dir)
    from mlx_vlm.models.gemma3 import config as vc
    from mlx_vlm.models.gemma3 import gemma3 as vg

    ckpt = write_checkpoint(Path(tempfile.mkdtemp()) / "c", "gemma3_mm", Path(tokenizer_dir))
    config = json.loads((ckpt / "config.json").read_text())
    weights = {k: mx.array(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    ours = gemma3.Model(gemma3.ModelArgs.from_dict(config))
    ours.load_weights(list(gemma3.sanitize(dict(weights)).items()))
    text = config["text_config"]
    mc = vc.ModelConfig.from_dict(config)
    mc.text_config = vc.TextConfig.from_dict({**text, "mm_tokens_per_image": 4})
    mc.vision_config = vc.VisionConfig.from_dict(config["vision_config"])
    mc.hidden_size, mc.pad_token_id = text["hidden_size"], 2044
    theirs = vg.Model(mc)
    theirs.load_weights(list(theirs.vision_tower.sanitize(dict(weights)).items()), strict=False)
    theirs.language_model.lm_head.weight = weights["language_model.model.embed_tokens.weight"]
    pixels = mx.array(np.random.default_rng(0).uniform(-1, 1, (1, 16, 16, 3)).astype(np.float32))
    features = ours.encode_images(pixels)
    reference = theirs.multi_modal_projector(theirs.vision_tower(pixels)[0])
    print(f"vision features  max |diff| {mx.abs(features - reference).max().item():.2e}")
    ids = mx.array([[0, 2, 379, 2047, 2047, 2047, 2047, 480, 203]])
    embedded = theirs.get_input_embeddings(ids, pixels.transpose(0, 3, 1, 2),
                                           mask=mx.ones(ids.shape)).inputs_embeds
    logits = theirs.language_model(inputs=ids, inputs_embeds=embedded, mask=None)
    logits = getattr(logits, "logits", logits)
    ours_logits = ours(ids, features=features)
    print(f"causal logits    max |diff| {mx.abs(ours_logits - logits).max().item():.2e}")
    first = mx.abs(ours_logits[0, -1] - logits[0, -1]).max().item()
    print(f"first token      max |diff| {first:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
