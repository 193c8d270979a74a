"""By hand: ferry's Nemotron-H MTP head (runner/models/_nemotron_h_mtp.py, fed as
runner/mtp_draft.py feeds it) beside mlx-vlm 0.7.10's `NemotronHMTPDraftModel` on the random
MTP fixture of tests/runner/nemotron_fixture.py, float32: the draft logits of a 12-position
catch-up call and of four single steps after it (the head's KV cache in use), with the same
target hidden states and tokens for both.

mlx-vlm is not a ferry dependency; unpack it beside, without its dependencies:
    python -m pip install --target /tmp/mlxvlm --no-deps mlx-vlm==0.7.10
    PYTHONPATH=$PWD:$PWD/tests/runner python -m bench.mtp_parity_mlx_vlm \
        /tmp/mlxvlm LLAMA_FIXTURE_DIR
(LLAMA_FIXTURE_DIR: any `make_checkpoint("llama")` output, for its tokenizer files.)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from nemotron_fixture import write_nemotron_checkpoint

from runner.models import nemotron_h
from runner.mtp_draft import feed


def main(mlx_vlm_dir: str, tokenizer_dir: str) -> None:
    sys.path.append(mlx_vlm_dir)
    from mlx_vlm.speculative.drafters.nemotron_h_mtp import ModelConfig, NemotronHMTPDraftModel

    ckpt = write_nemotron_checkpoint(Path(tempfile.mkdtemp()) / "c", Path(tokenizer_dir),
                                     mtp="random")
    config = json.loads((ckpt / "config.json").read_text())
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(ckpt / "model.safetensors"))
               .items()}
    ours = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(config))
    ours.load_weights(list(nemotron_h.sanitize(dict(weights)).items()), strict=True)
    head = ours.draft_head()
    assert head is not None

    theirs = NemotronHMTPDraftModel(ModelConfig(text_config=dict(config)))
    mtp = {k.removeprefix("mtp."): v for k, v in weights.items() if k.startswith("mtp.")}
    theirs.load_weights(list(theirs.sanitize(mtp).items()), strict=True)
    theirs._input_embed = ours.backbone.embeddings  # bind(): the target's own, shared
    theirs._lm_head_fn = ours.lm_head

    rng = np.random.default_rng(1)
    tokens = [int(t) for t in rng.integers(5, 2048, 16)]
    hidden = mx.array(rng.standard_normal((1, 16, config["hidden_size"])), mx.float32)
    our_cache, their_cache = head.make_cache(), theirs.make_cache()
    spans = [(0, 12)] + [(i, i + 1) for i in range(12, 16)]
    worst = 0.0
    for a, b in spans:
        mine = ours._logits(feed(ours, head, tokens[a:b], hidden[:, a:b], our_cache))
        out, _ = theirs._forward_hidden(ours.backbone.embeddings(mx.array([tokens[a:b]])),
                                        hidden[:, a:b], None, their_cache)
        reference = theirs._lm_head_fn(out)
        diff = mx.abs(mine - reference).max().item()
        worst = max(worst, diff)
        same = (mx.argmax(mine, -1) == mx.argmax(reference, -1)).all().item()
        print(f"positions {a:2d}..{b - 1:2d}  draft logits max |diff| {diff:.2e}  "
              f"(max |value| {mx.abs(reference).max().item():.2e}), same argmax: {same}")
    print(f"worst max |diff| {worst:.2e}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
