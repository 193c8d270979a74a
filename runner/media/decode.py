"""Bytes -> RGB image, refusing what must never reach a vision tower.

Pillow opens lazily: the header gives the size before any pixel is decoded, so a decompression
bomb is refused before it costs memory. Every refusal is a `MediaError` (a ValueError), which the
servers answer with 400.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

MAX_PIXELS = 50_000_000  # 50 megapixels


class MediaError(ValueError):
    """The input is not an image this runner accepts; the message says why."""


def decode_image(data: bytes) -> Image.Image:
    """An RGB image from encoded bytes (PNG, JPEG, WebP, GIF, ...)."""
    if not data:
        raise MediaError("image is empty")
    if _is_audio(data):
        raise MediaError("audio input is not supported: ferry's runners read images only")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_size(image.size)
            image.load()
    except UnidentifiedImageError as exc:
        raise MediaError("input is not a recognised image format") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise MediaError(f"image is larger than {MAX_PIXELS // 1_000_000} megapixels") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError("image data is corrupt or truncated") from exc
    return image.convert("RGB")


def _check_size(size: tuple[int, int]) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError("image has no pixels")
    if width * height > MAX_PIXELS:
        raise MediaError(f"image is {width}x{height}, larger than "
                         f"{MAX_PIXELS // 1_000_000} megapixels")


def _is_audio(data: bytes) -> bool:
    """WAV, FLAC, Ogg, MP3 (ID3 tag or a bare frame sync): refused as audio, by name, rather
    than as an unknown image format."""
    head = data[:12]
    return ((head[:4] == b"RIFF" and head[8:12] == b"WAVE") or head[:4] in (b"fLaC", b"OggS")
            or head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0))
