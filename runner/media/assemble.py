"""Prompt ids with image markers + the images -> the ids, spans and pixels a vision model runs.

A vision model offers `image_tokens` (start, end ids and tokens per image), `image_size` (the
square its tower takes), `encode_images` and `bind_images`; any such model uses this path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from runner.media.decode import MediaError, decode_image
from runner.media.placeholders import ImageTokens, expand
from runner.media.preprocess import ProcessorConfig, pixel_values
from runner.media.prompt import MARKER, image_keys


@dataclass
class ImageRequest:
    tokens: list[int]
    spans: list[tuple[int, int]]
    pixels: list[np.ndarray] = field(default_factory=list)
    keys: list[list[int]] = field(default_factory=list)


def is_vision_model(model: Any) -> bool:
    return callable(getattr(model, "encode_images", None))


def assemble(model: Any, files: dict[str, bytes], ids: Sequence[int],
             images: Sequence[bytes]) -> ImageRequest:
    """Decode and preprocess every image (MediaError for bad ones), expand the markers, and
    key each image's run by its content."""
    start, end, count = model.image_tokens()
    processor = ProcessorConfig.from_files(files, model.image_size())
    pixels = [pixel_values(decode_image(data), processor) for data in images]
    expanded, spans = expand(ids, ImageTokens(MARKER, start, MARKER, end), [count] * len(images))
    keys = [image_keys(data, count) for data in images]
    for (a, b), run in zip(spans, keys, strict=True):
        expanded[a:b] = run
    if MARKER in expanded:
        raise MediaError("an image placeholder was left unexpanded")
    return ImageRequest(expanded, spans, pixels, keys)


def bind(model: Any, request: ImageRequest) -> None:
    """Run the vision tower over the request's images and hand the model its feature rows."""
    if not request.pixels:
        model.bind_images({})
        return
    features = model.encode_images(mx.array(np.stack(request.pixels)))
    rows: dict[int, mx.array] = {}
    for image, run in enumerate(request.keys):
        rows.update({key: features[image, i] for i, key in enumerate(run)})
    model.bind_images(rows)
