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


@pytest.mark.parametrize("sizes", [[(30, 50)], [(800, 20), (5, 5)], [(64, 64), (3, 90), (17, 17)]])
def test_placeholder_ids_match_transformers_gemma3_processor(sizes) -> None:
    """Each image's run (blank line, start, image tokens, end, blank line) as transformers'
    Gemma3Processor writes it, for images of several sizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import Gemma3ImageProcessor, Gemma3Processor, PreTrainedTokenizerFast
    from runner.media.prompt import MARKER, encode_marked
    from runner.models.gemma3 import Model
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<start_of_image>": 3, "<end_of_image>": 4,
             "<image_soft_token>": 5, "a": 6, "\n": 7, "b": 8, "[UNK]": 9}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(Gemma3ImageProcessor(size={"height": 28, "width": 28}),
                                tokenizer, image_seq_length=4)
    images = [Image.new("RGB", size) for size in sizes]
    prompt = "".join(f"a{'b' * i}<start_of_image>" for i in range(len(images))) + "ab"
    expected = processor(text=[prompt], images=[images], return_tensors="np",
                         add_special_tokens=False)["input_ids"][0].tolist()
    sentinel = "<ferry-image-x>"
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    ids = encode_marked(prompt.replace("<start_of_image>", sentinel), sentinel, encode, encode,
                        Model.IMAGE_TEXT_AROUND)
    ours, _ = expand(ids, ImageTokens(MARKER, 3, 5, 4), [4] * len(images))
    assert ours == expected


def test_image_slots_give_distinct_images_distinct_keys_and_the_same_image_the_same():
    from runner.media.prompt import IMAGE_KEY_BASE, ImageSlots, image_digest

    slots = ImageSlots()
    a, b = image_digest(b"image a"), image_digest(b"image b")
    first = slots.keys([a, b], [3, 2], lambda: pytest.fail("no reset while slots are free"))
    assert len(set(first[0]) | set(first[1])) == 5
    assert all(k >= IMAGE_KEY_BASE for run in first for k in run)
    assert slots.keys([b], [2], lambda: None) == [first[1]]  # the same image keeps its keys


def test_image_slots_reset_together_with_the_prefix_cache_and_never_collide():
    from runner.media.prompt import ImageSlots, image_digest

    resets: list[int] = []
    slots = ImageSlots(capacity=3)
    digests = [image_digest(bytes([i])) for i in range(5)]
    slots.keys(digests[:2], [1, 1], lambda: resets.append(1))
    assert not resets
    # two new images do not fit beside two old ones: the table (and the prefix cache, through
    # the callback) resets *before* any of this request's images gets a slot
    runs = slots.keys(digests[2:4], [1, 1], lambda: resets.append(1))
    assert resets == [1]
    assert runs[0] != runs[1]
    again = slots.keys([digests[0]], [1], lambda: resets.append(1))
    assert again[0] not in runs  # an image from before the reset gets a fresh slot


def test_an_image_run_longer_than_the_key_space_is_refused():
    from runner.media.prompt import ImageSlots, image_digest

    with pytest.raises(MediaError, match="longer than supported"):
        ImageSlots().keys([image_digest(b"x")], [5000], lambda: None)


def test_a_context_holding_image_keys_is_refused_with_a_reason():
    from runner.media.prompt import IMAGE_KEY_BASE
    from runner.server import _context
    from runner.tokenizer import PromptError

    assert _context([1, 2]) == [1, 2]
    with pytest.raises(PromptError, match="send the images again"):
        _context([1, IMAGE_KEY_BASE + 5])
