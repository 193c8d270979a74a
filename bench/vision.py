#!/usr/bin/env python3
"""Benchmark: image preprocessing and the Gemma 3 vision tower per image, and the first-token
latency of a prompt with one image, in-process on a random-weight model.

    .venv/bin/python bench/vision.py [--layers 12] [--hidden 768] [--image 224] [--repeat 3]
        [--mlx-vlm DIR]

The tower has SigLIP-base's shape by default (12 layers, hidden 768, patch 16, 224 px, so 196
patches pooled to 49 image tokens); the text model is small (4 layers, hidden 512), so the
first-token figure is mostly the tower plus a 70-token prefill. Preprocessing (Pillow decode +
resize + normalise) is timed for a 640x480 and a 3000x2000 PNG. With `--mlx-vlm DIR` (mlx-vlm
0.7.10 installed there with `pip install --target DIR --no-deps mlx-vlm==0.7.10`), mlx-vlm's
SigLIP tower and projector run on the same weights and pixels beside ferry's. float32, best of
`--repeat`. On Linux run it as the runner runs (OpenBLAS preloaded, else MLX's CPU matmuls
are ~40x slower):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 .venv/bin/python ...

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
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mlx-vlm", dest="mlx_vlm")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
