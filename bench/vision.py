#!/usr/bin/env python3
"""Benchmark: image preprocessing and the vision tower per image, and the first-token latency
of a prompt with one image, in-process on random-weight models: Gemma 3 (SigLIP) and Nemotron-H
VL (RADIO, tiled).

    .venv/bin/python bench/vision.py [--arch gemma3|nemotron_h_vl|all] [--layers 12]
        [--hidden 768] [--image 224] [--repeat 3] [--mlx-vlm DIR]

The tower has SigLIP-base's shape by default (12 layers, hidden 768, patch 16, 224 px, so 196
patches pooled to 49 image tokens); the text model is small (4 layers, hidden 512), so the
first-token figure is mostly the tower plus a 70-token prefill. Preprocessing (Pillow decode +
resize + normalise) is timed for a 640x480 and a 3000x2000 PNG. With `--mlx-vlm DIR` (mlx-vlm
0.7.10 installed there with `pip install --target DIR --no-deps mlx-vlm==0.7.10`), mlx-vlm's
SigLIP tower and projector run on the same weights and pixels beside ferry's. float32, best of
`--repeat`. On Linux run it as the runner runs (OpenBLAS preloaded, else MLX's CPU matmuls
are ~40x slower):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 .venv/bin/python ...

Nemotron-H VL rows: tests/runner/nemotron_vl_fixture.py's checkpoint with a larger RADIO tower
(--nemotron-layers x 384 wide, patch 16, 256-pixel tiles: 64 image tokens per tile after the
pixel shuffle) and its tiny Nemotron-H language model. Preprocessing is decode + InternVL tiling
(+ thumbnail) + normalise, for a 256x256 (one tile) and a 640x480 PNG (12 tiles + thumbnail);
the tower + projector runs over all of an image's tiles; the first token is the prompt with the
640x480 image's tokens. With
`--mlx-vlm DIR` its `nemotron_h_nano_omni` model runs the same tiles (extract_feature) and the
same prompt (as bench/vision_parity_nemotron_mlx_vlm.py drives it).

Measured 2026-12-03 on the shared 2-core machine under load (other engineers' tests running),
OpenBLAS preloaded: preprocess 6.4 ms (640x480) / 84.7 ms (3000x2000); tower + projector
566 ms/image (mlx-vlm 0.7.10 same run: 553 ms); first token with one image 583 ms.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.media.decode import decode_image
from runner.media.preprocess import ProcessorConfig, pixel_values
from runner.models import gemma3


def best(repeat: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(work())
        times.append(time.perf_counter() - start)
    return min(times)


def build(args: argparse.Namespace) -> tuple[dict, gemma3.Model]:
    patches = args.image // 16
    config = {"model_type": "gemma3", "vocab_size": 4096,
              "mm_tokens_per_image": (patches // 2) ** 2,
              "image_token_index": 4095, "boi_token_index": 4093, "eoi_token_index": 4094,
              "text_config": {"hidden_size": 512, "intermediate_size": 1024,
                              "num_hidden_layers": 4, "num_attention_heads": 8,
                              "num_key_value_heads": 4, "head_dim": 64},
              "vision_config": {"hidden_size": args.hidden, "intermediate_size": args.hidden * 4,
                                "num_hidden_layers": args.layers, "num_attention_heads": 12,
                                "image_size": args.image, "patch_size": 16}}
    model = gemma3.Model(gemma3.ModelArgs.from_dict(config))
    rng = np.random.default_rng(0)
    model.update(tree_unflatten([(k, mx.array(rng.normal(0, 0.02, v.shape).astype(np.float32)))
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return config, model


def png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=("gemma3", "nemotron_h_vl", "all"), default="all")
    parser.add_argument("--nemotron-layers", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mlx-vlm", dest="mlx_vlm")
    args = parser.parse_args()
    if args.arch in ("gemma3", "all"):
        gemma3_rows(args)
    if args.arch in ("nemotron_h_vl", "all"):
        nemotron_rows(args)


def gemma3_rows(args: argparse.Namespace) -> None:
    print("Gemma 3 (SigLIP tower)")
    config, model = build(args)
    processor = ProcessorConfig.from_dict({}, args.image)
    for width, height in ((640, 480), (3000, 2000)):
        data = png(width, height)
        seconds = best(args.repeat, lambda d=data: mx.array(pixel_values(decode_image(d),
                                                                          processor)))
        print(f"preprocess {width}x{height} PNG: {seconds * 1000:.1f} ms")
    pixels = mx.array(pixel_values(decode_image(png(640, 480)), processor)[None])
    tower = best(args.repeat, lambda: model.encode_images(pixels))
    print(f"ferry vision tower + projector: {tower * 1000:.1f} ms/image")
    count = config["mm_tokens_per_image"]
    ids = mx.array([[1, 5, 6, 7, 4093] + [4095] * count + [4094, 8, 9, 10]])
    spans = [(5, 5 + count)]

    def first_token() -> mx.array:
        return mx.argmax(model(ids, spans=spans, features=model.encode_images(pixels))[0, -1])
    print(f"first token, one image ({ids.shape[1]} prompt tokens): "
          f"{best(args.repeat, first_token) * 1000:.1f} ms")
    if args.mlx_vlm:
        compare_mlx_vlm(args, config, model, pixels)


def compare_mlx_vlm(args: argparse.Namespace, config: dict, model: gemma3.Model,
                    pixels: mx.array) -> None:
    sys.path.append(args.mlx_vlm)
    from mlx_vlm.models.gemma3 import config as vc
    from mlx_vlm.models.gemma3 import gemma3 as vg
    mc = vc.ModelConfig.from_dict(config)
    mc.text_config = vc.TextConfig.from_dict({**config["text_config"], "model_type": "gemma3_text",
                                              "mm_tokens_per_image": config["mm_tokens_per_image"]})
    mc.vision_config = vc.VisionConfig.from_dict({**config["vision_config"],
                                                  "model_type": "siglip_vision_model"})
    theirs = vg.Model(mc)
    theirs.load_weights(tree_flatten(model.parameters()), strict=False)

    def encode() -> mx.array:
        return theirs.multi_modal_projector(theirs.vision_tower(pixels)[0])
    print(f"mlx-vlm vision tower + projector: {best(args.repeat, encode) * 1000:.1f} ms/image")


REPO = Path(__file__).resolve().parents[1]
RADIO = {"model_type": "radio", "version": "radio_v2.5-h", "hidden_size": 384,
         "num_attention_heads": 6, "intermediate_size": 1536, "patch_size": 16,
         "max_resolution": 512, "args": {"cpe_max_size": 512, "register_multiple": 4,
                                          "teachers": [{"name": "clip"}, {"name": "siglip"}]}}


def nemotron_rows(args: argparse.Namespace) -> None:
    import json
    import subprocess
    import tempfile

    from safetensors.numpy import load_file

    from runner.models import nemotron_h_vl
    sys.path.insert(0, str(REPO / "tests" / "runner"))
    from nemotron_vl_fixture import IMAGE_TOKENS, write_nemotron_vl_checkpoint

    shared = REPO / "shared" if (REPO / "shared").is_dir() else REPO.parent / "shared"
    work = Path(tempfile.mkdtemp(prefix="ferry-bench-vision-"))
    subprocess.run([sys.executable, str(shared / "fixtures" / "make_checkpoint.py"), "--out",
                    str(work / "llama"), "--arch", "llama", "--preset", "tiny", "--force"],
                   check=True, stdout=subprocess.DEVNULL)
    vision = {**RADIO, "num_hidden_layers": args.nemotron_layers}
    ckpt = write_nemotron_vl_checkpoint(work / "vl", work / "llama", vision_config=vision,
                                        force_image_size=256, patch_size=16,
                                        vit_hidden_size=384, projector_hidden_size=512)
    processor = json.loads((ckpt / "preprocessor_config.json").read_text())
    (ckpt / "preprocessor_config.json").write_text(json.dumps({**processor, "image_size": 256}))
    config = json.loads((ckpt / "config.json").read_text())
    weights = {k: mx.array(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    model = nemotron_h_vl.Model(nemotron_h_vl.ModelArgs.from_dict(config))
    model.load_weights(list(nemotron_h_vl.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.suffix == ".json"}
    theirs = _mlx_vlm_nemotron(args.mlx_vlm, config, weights) if args.mlx_vlm else None
    print(f"\nNemotron-H VL (RADIO {args.nemotron_layers} layers x 384, 256-px tiles)")
    images = {}
    for width, height in ((256, 256), (640, 480)):
        data = png(width, height)
        pre = best(args.repeat, lambda d=data: mx.array(model.image_tiles(decode_image(d),
                                                                          files)))
        tiles = images[width] = mx.array(model.image_tiles(decode_image(data), files))
        tower = best(args.repeat, lambda t=tiles: model.encode_images(t))
        line = (f"{width}x{height} PNG, {tiles.shape[0]} tiles: preprocess {pre * 1000:.1f} ms, "
                f"ferry tower + projector {tower * 1000:.1f} ms")
        if theirs is not None:
            ref = best(args.repeat, lambda t=tiles: theirs.extract_feature(t.transpose(0, 3, 1, 2)))
            line += f", mlx-vlm {ref * 1000:.1f} ms"
        print(line)
    tiles = images[640]
    count = tiles.shape[0] * model.args.tokens_per_tile
    ids = mx.array([[0, 2, 379, IMAGE_TOKENS["<img>"]] + [IMAGE_TOKENS["<image>"]] * count
                    + [IMAGE_TOKENS["</img>"], 480, 203]])

    def first_token() -> mx.array:
        return mx.argmax(model(ids, features=model.encode_images(tiles))[0, -1])
    line = (f"first token, one 640x480 image ({ids.shape[1]} prompt tokens): ferry "
            f"{best(args.repeat, first_token) * 1000:.1f} ms")
    if theirs is not None:
        def their_first() -> mx.array:
            embedded = theirs.get_input_embeddings(ids, tiles.transpose(0, 3, 1, 2))
            out = theirs.language_model(ids, inputs_embeds=embedded.inputs_embeds)
            return mx.argmax(getattr(out, "logits", out)[0, -1])
        line += f", mlx-vlm {best(args.repeat, their_first) * 1000:.1f} ms"
    print(line)


def _mlx_vlm_nemotron(directory: str, config: dict, weights: dict) -> object:
    import json

    sys.path.append(directory)
    from mlx_vlm.models.nemotron_h_nano_omni import config as vc
    from mlx_vlm.models.nemotron_h_nano_omni import nemotron_h_nano_omni as vm
    theirs = vm.Model(vc.ModelConfig.from_dict(json.loads(json.dumps(config))))
    theirs.load_weights(list(theirs.sanitize(theirs.language_model.sanitize(dict(weights)))
                             .items()), strict=False)
    mx.eval(theirs.parameters())
    return theirs


if __name__ == "__main__":
    main()
