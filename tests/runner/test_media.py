"""The shared media pipeline: decode refusals, preprocessing parity with transformers' Gemma 3
image processor, and placeholder expansion."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
from PIL import Image

from runner.media.decode import MediaError, decode_image
from runner.media.placeholders import ImageTokens, expand
from runner.media.preprocess import ProcessorConfig, pixel_values


def _png(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    if mode == "RGB":
        image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    else:
        image = Image.new(mode, size)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_decode_gives_rgb() -> None:
    image = decode_image(_png((7, 5), mode="L"))
    assert image.mode == "RGB" and image.size == (7, 5)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"this is plain text, not an image", "not a recognised image"),
    (_png((40, 40))[:60], "corrupt"),
])
def test_decode_refuses_bad_input(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        decode_image(data)


def test_decode_refuses_over_50_megapixels() -> None:
    huge = _png((8000, 7000), mode="1")  # 56 MP, a few kB as a 1-bit PNG
    with pytest.raises(MediaError, match="50 megapixels"):
        decode_image(huge)


@pytest.mark.parametrize("size", [(32, 32), (50, 17), (13, 64)])
def test_pixels_match_transformers_gemma3_processor(size: tuple[int, int]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import Gemma3ImageProcessor
    reference = Gemma3ImageProcessor(size={"height": 28, "width": 28})
    image = decode_image(_png(size, seed=size[0]))
    expected = reference(images=[image], return_tensors="np")["pixel_values"][0]
    config = ProcessorConfig.from_dict(reference.to_dict(), default_size=896)
    ours = pixel_values(image, config)
    assert ours.shape == (28, 28, 3)
    np.testing.assert_allclose(ours, expected.transpose(1, 2, 0), atol=1e-5)


def test_expand_places_image_tokens_in_order() -> None:
    tokens = ImageTokens(marker=9, start=9, image=7, end=8)
    ids, spans = expand([1, 9, 2, 9, 3], tokens, [2, 3])
    assert ids == [1, 9, 7, 7, 8, 2, 9, 7, 7, 7, 8, 3]
    assert spans == [(2, 4), (7, 10)]
    assert all(ids[a:b] == [7] * (b - a) for a, b in spans)


def test_expand_refuses_a_count_mismatch() -> None:
    with pytest.raises(MediaError, match="2 image placeholders but 1 images"):
        expand([9, 9], ImageTokens(9, 9, 7, 8), [4])
