"""Image -> pixel array, with the constants the checkpoint's `preprocessor_config.json` gives
(size, rescale factor, mean, std), so a model sees exactly what its processor would produce."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS,
             2: Image.Resampling.BILINEAR, 3: Image.Resampling.BICUBIC}


@dataclass(frozen=True)
class ProcessorConfig:
    height: int
    width: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL's numbering, as Hugging Face processors store it

    @classmethod
    def from_dict(cls, raw: dict[str, Any], default_size: int) -> ProcessorConfig:
        size = raw.get("size") or {}
        return cls(int(size.get("height", default_size)), int(size.get("width", default_size)),
                   tuple(raw.get("image_mean", cls.mean)), tuple(raw.get("image_std", cls.std)),
                   float(raw.get("rescale_factor", cls.rescale_factor)),
                   int(raw.get("resample", cls.resample)))

    @classmethod
    def from_files(cls, files: dict[str, bytes], default_size: int) -> ProcessorConfig:
        raw = files.get("preprocessor_config.json")
        return cls.from_dict(json.loads(raw) if raw else {}, default_size)


def resize(image: Image.Image, height: int, width: int, resample: int = 2) -> Image.Image:
    return image.resize((width, height), _RESAMPLE.get(resample, Image.Resampling.BILINEAR))


def normalise(image: Image.Image, config: ProcessorConfig) -> np.ndarray:
    """(H, W, 3) float32: rescaled, then (x - mean) / std per channel."""
    pixels = np.asarray(image, dtype=np.float32) * np.float32(config.rescale_factor)
    mean = np.asarray(config.mean, dtype=np.float32)
    std = np.asarray(config.std, dtype=np.float32)
    return (pixels - mean) / std


def pixel_values(image: Image.Image, config: ProcessorConfig) -> np.ndarray:
    """What a fixed-resolution tower (SigLIP) takes: resized and normalised, channels last."""
    return normalise(resize(image, config.height, config.width, config.resample), config)
