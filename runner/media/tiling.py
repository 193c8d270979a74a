"""Dynamic-resolution tiling (InternVL's rule, which Nemotron-H VL's processor uses): an image is
resized to the grid of square tiles whose aspect ratio is closest to its own, within a tile
budget, cut into those tiles, and, when there is more than one, followed by a thumbnail of the
whole image. Every tile then costs the same fixed number of image tokens, so the placeholder
count of an image is known from its size alone (`tile_count`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from runner.media.preprocess import ProcessorConfig, normalise


@dataclass(frozen=True)
class TilingConfig:
    """The processor's constants: tile side, tile budget, thumbnail, normalisation."""

    tile: int
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], defaults: TilingConfig) -> TilingConfig:
        """preprocessor_config.json's keys over the model config's (`defaults`)."""
        return cls(int(raw.get("image_size", defaults.tile)),
                   int(raw.get("min_num_tiles", raw.get("min_dynamic_patch", defaults.min_tiles))),
                   int(raw.get("max_num_tiles", raw.get("max_dynamic_patch", defaults.max_tiles))),
                   bool(raw.get("use_thumbnail", defaults.thumbnail)),
                   tuple(raw.get("norm_mean", raw.get("image_mean", defaults.mean))),
                   tuple(raw.get("norm_std", raw.get("image_std", defaults.std))))

    @classmethod
    def from_files(cls, files: dict[str, bytes], defaults: TilingConfig) -> TilingConfig:
        raw = files.get("preprocessor_config.json")
        return cls.from_dict(json.loads(raw) if raw else {}, defaults)


def _grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """Every (columns, rows) grid within the budget, fewest tiles first. Equal counts keep the
    set's order, as the source processor's does, so exact ties resolve as they do there."""
    grids = {(c, r) for n in range(min_tiles, max_tiles + 1) for c in range(1, n + 1)
             for r in range(1, n + 1) if min_tiles <= c * r <= max_tiles}
    return sorted(grids, key=lambda g: g[0] * g[1])


def tile_grid(width: int, height: int, config: TilingConfig) -> tuple[int, int]:
    """(columns, rows): the grid whose aspect is nearest the image's; on a tie the larger grid
    wins when the image has more than half its pixels."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for cols, rows in _grids(config.min_tiles, config.max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * config.tile ** 2 * cols * rows:
            best = (cols, rows)
    return best


def tile_count(width: int, height: int, config: TilingConfig) -> int:
    """How many tiles an image of this size becomes (thumbnail included)."""
    cols, rows = tile_grid(width, height, config)
    return cols * rows + (1 if config.thumbnail and cols * rows > 1 else 0)


def tiles(image: Image.Image, config: TilingConfig) -> np.ndarray:
    """(tiles, tile, tile, 3) float32 pixels, normalised, row-major tiles then the thumbnail."""
    cols, rows = tile_grid(image.width, image.height, config)
    side = config.tile
    resized = np.asarray(image.resize((cols * side, rows * side), Image.Resampling.BICUBIC))
    cut = resized.reshape(rows, side, cols, side, 3).transpose(0, 2, 1, 3, 4)
    parts = list(cut.reshape(rows * cols, side, side, 3))
    if config.thumbnail and rows * cols > 1:
        parts.append(np.asarray(image.resize((side, side), Image.Resampling.BICUBIC)))
    scale = ProcessorConfig(side, side, config.mean, config.std)
    return np.stack([normalise(Image.fromarray(p), scale) for p in parts])
