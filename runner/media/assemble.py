"""Prompt ids with image markers + the images -> the ids, spans and pixels a vision model runs.

A vision model offers `encode_images` (a batch of same-size pixel arrays -> their feature rows)
and `bind_images`, and one of two ways to make pixels: a fixed-resolution tower (SigLIP) offers
`image_tokens` (start, end ids and tokens per image) and `image_size` (the square it takes); a
tiling one (RADIO) offers `image_tiles(image, files)` (an image's tiles) and
`tiled_image_tokens(files)` (start, end ids and tokens per tile). Any such model uses this path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from runner.media.decode import MediaError, decode_image
from runner.media.placeholders import ImageTokens, expand
from runner.media.preprocess import ProcessorConfig, pixel_values
from runner.media.prompt import MARKER, ImageSlots, image_digest


@dataclass
class ImageRequest:
    """The prompt's ids with each image's run left as MARKER until `key_images` fills it."""

    tokens: list[int]
    spans: list[tuple[int, int]]
    pixels: list[np.ndarray] = field(default_factory=list)  # per image: (tiles, H, W, 3)
    digests: list[bytes] = field(default_factory=list)
    keys: list[list[int]] = field(default_factory=list)


def key_images(request: ImageRequest, tokens: list[int], slots: ImageSlots,
               on_reset: Callable[[], None]) -> None:
    """Write each image's keys into `tokens` (the request's ids, perhaps after a context that
    `request.spans` already count) and into `request.keys`."""
    counts = [b - a for a, b in request.spans]
    request.keys = slots.keys(request.digests, counts, on_reset)
    for (a, b), run in zip(request.spans, request.keys, strict=True):
        tokens[a:b] = run


ENCODE_BATCH = 4  # tiles per vision-tower call: bounds the tower's activations


def is_vision_model(model: Any) -> bool:
    return callable(getattr(model, "encode_images", None))


def _pixels(model: Any, files: dict[str, bytes], images: Sequence[bytes]
            ) -> tuple[int, int, int, list[np.ndarray]]:
    """(start id, end id, tokens per tile, each image's tiles); an untiled image is one tile."""
    if callable(getattr(model, "image_tiles", None)):
        start, end, count = model.tiled_image_tokens(files)
        return start, end, count, [model.image_tiles(decode_image(d), files) for d in images]
    start, end, count = model.image_tokens()
    processor = ProcessorConfig.from_files(files, model.image_size())
    return start, end, count, [pixel_values(decode_image(d), processor)[None] for d in images]


def assemble(model: Any, files: dict[str, bytes], ids: Sequence[int],
             images: Sequence[bytes]) -> ImageRequest:
    """Decode and preprocess every image (MediaError for bad ones) and expand the markers; the
    runs are keyed later, on the generation worker (`key_images`)."""
    start, end, per_tile, pixels = _pixels(model, files, images)
    counts = [len(tiles) * per_tile for tiles in pixels]
    expanded, spans = expand(ids, ImageTokens(MARKER, start, MARKER, end), counts)
    if expanded.count(MARKER) != sum(counts):
        raise MediaError("an image placeholder was left unexpanded")
    return ImageRequest(expanded, spans, pixels, [image_digest(data) for data in images])


def bind(model: Any, request: ImageRequest) -> None:
    """Run the vision tower over the request's tiles, a few at a time, and hand the model the
    feature row of each image key."""
    if not request.pixels:
        model.bind_images({})
        return
    tiles = np.concatenate(request.pixels)
    parts = []
    for i in range(0, len(tiles), ENCODE_BATCH):
        part = model.encode_images(mx.array(tiles[i:i + ENCODE_BATCH]))
        mx.eval(part)
        parts.append(part.reshape(-1, part.shape[-1]))
    rows = mx.concatenate(parts)
    bound: dict[int, mx.array] = {}
    offset = 0
    for run in request.keys:
        bound.update({key: rows[offset + i] for i, key in enumerate(run)})
        offset += len(run)
    model.bind_images(bound)
