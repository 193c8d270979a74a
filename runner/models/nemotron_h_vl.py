"""Nemotron-H VL (NemotronH_Nano_VL_V2 checkpoints): the RADIO vision tower (_radio.py), an MLP
projector, and the Nemotron-H language model of `nemotron_h`, wrapped, not copied.

An image is cut into square tiles (runner.media.tiling: InternVL's grid rule plus a thumbnail);
each tile's RADIO patch features go through a pixel shuffle that folds every 2x2 block of
patches into one vector (`downsample_ratio` 0.5), then RMSNorm -> linear -> squared ReLU ->
linear (`mlp1`), giving (tile / patch)^2 / 4 tokens per tile between `<img>` and `</img>`.
The features replace the embeddings of the image tokens; attention over them stays causal, as
in the source model, so `spans` are accepted (the runner passes them) and ignored. An audio
tower (`sound_encoder`, `sound_projection`) is kept in the store by create and not loaded. The
language model's MTP head (`mtp.*` or `language_model.mtp.*`) is its draft, as for text.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from PIL import Image

from runner.kv_cache import KVCache, RecurrentCache
from runner.media.placeholders import token_id
from runner.media.prompt import IMAGE_KEY_BASE
from runner.media.scatter import embed_with_images
from runner.media.tiling import TilingConfig, tiles
from runner.models import _radio as radio
from runner.models import nemotron_h as text
from runner.nn.linear import Linear
from runner.nn.norm import RMSNorm

ARCHITECTURES = ("NemotronH_Nano_VL_V2",)
VISION_ARCHITECTURES = ARCHITECTURES
# not run for images: the audio tower, RADIO's summary indices and its video patch embedder
_DROPPED = ("sound_encoder.", "sound_projection.", "vision_model.radio_model.summary_idxs",
            "vision_model.summary_idxs",
            "vision_model.radio_model.model.patch_generator.video_embedder.")


@dataclass
class ModelArgs:
    model_type: str
    text: text.ModelArgs
    vision: radio.RadioArgs = field(default_factory=radio.RadioArgs)
    downsample_ratio: float = 0.5
    ps_version: str = "v1"
    projector_hidden_size: int = 4096
    vit_hidden_size: int | None = None
    img_context_token_id: int = 18
    img_start_token: str = "<img>"
    img_end_token: str = "</img>"
    force_image_size: int = 512
    use_thumbnail: bool = True
    max_num_tiles: int = 12
    norm_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    norm_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    vision_final_layernorm: bool | None = None

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        llm = params.get("llm_config") or params.get("text_config") or {}
        vision = radio.RadioArgs.from_dict(params.get("vision_config") or {})
        known = inspect.signature(cls).parameters
        rest = {k: v for k, v in params.items()
                if k in known and k not in ("model_type", "text", "vision") and v is not None}
        args = cls(str(params.get("model_type") or "nemotron_h_vl"),
                   text.ModelArgs.from_dict({**llm, "model_type": "nemotron_h"}), vision, **rest)
        if args.vision_final_layernorm is None:  # the source turns it on with the MTP heads
            args.vision_final_layernorm = int(llm.get("num_nextn_predict_layers") or 0) > 0
        return args

    def __getattr__(self, name: str) -> Any:
        """The language model's fields (hidden_size, vocab_size, ...), which the loader and
        create read from any architecture's args."""
        if name == "text":
            raise AttributeError(name)
        return getattr(self.text, name)

    @property
    def vit_width(self) -> int:
        return self.vit_hidden_size or self.vision.hidden_size

    @property
    def shuffle(self) -> int:
        """Patches folded per side by the pixel shuffle (2 for downsample_ratio 0.5)."""
        return round(1 / self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        return (self.force_image_size // self.vision.patch_size // self.shuffle) ** 2

    def tiling(self) -> TilingConfig:
        return TilingConfig(self.force_image_size, 1, self.max_num_tiles, self.use_thumbnail,
                            tuple(self.norm_mean), tuple(self.norm_std))  # type: ignore[arg-type]


class VisionModel(nn.Module):
    """Named as the checkpoint names it: `vision_model.radio_model.*`."""

    def __init__(self, args: radio.RadioArgs) -> None:
        super().__init__()
        self.radio_model = radio.RadioModel(args)


class SquaredReLU(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return nn.relu2(x)


def pixel_shuffle(x: mx.array, fold: int, v1: bool) -> mx.array:
    """(N, rows, cols, D) -> (N, rows/fold, cols/fold, D*fold^2): each fold x fold block of
    patches becomes one vector, columns folded first, then rows. "v1" checkpoints were trained
    with the result's two grid axes swapped, and keep it that way."""
    n, rows, cols, d = x.shape
    x = x.reshape(n, rows, cols // fold, d * fold).transpose(0, 2, 1, 3)
    x = x.reshape(n, cols // fold, rows // fold, d * fold * fold)
    return x if v1 else x.transpose(0, 2, 1, 3)


class Model(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = text.Model(args.text)
        self.vision_model = VisionModel(args.vision)
        wide = args.vit_width * args.shuffle ** 2
        self.mlp1 = [RMSNorm(wide, 1e-5), Linear(wide, args.projector_hidden_size),
                     SquaredReLU(), Linear(args.projector_hidden_size, args.text.hidden_size)]
        if args.vision_final_layernorm:
            self.vision_final_layernorm = nn.LayerNorm(args.vit_width,
                                                       eps=args.vision.layer_norm_eps)
        self._bound: dict[int, mx.array] = {}

    @property
    def layers(self) -> list[text.Block]:
        return self.language_model.layers

    def make_cache(self) -> list[KVCache | RecurrentCache]:
        return self.language_model.make_cache()

    def tiled_image_tokens(self, files: dict[str, bytes]) -> tuple[int, int, int]:
        """(start id, end id, tokens per tile): `<img>` and `</img>` from the tokenizer."""
        args = self.args
        return (token_id(files, args.img_start_token), token_id(files, args.img_end_token),
                args.tokens_per_tile)

    def image_tiles(self, image: Image.Image, files: dict[str, bytes]) -> np.ndarray:
        """(tiles, side, side, 3) normalised pixels: the processor's tiling of one image."""
        return tiles(image, TilingConfig.from_files(files, self.args.tiling()))

    def bind_images(self, rows: dict[int, mx.array]) -> None:
        """The feature row of each image key (runner.media.prompt) the next calls may carry."""
        self._bound = rows

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, H, W, 3) normalised tiles -> (N, tokens per tile, text hidden) features."""
        fold, patch = self.args.shuffle, self.args.vision.patch_size
        dtype = self.mlp1[1].weight.dtype
        features = self.vision_model.radio_model(pixels.astype(dtype))
        if "vision_final_layernorm" in self:
            features = self.vision_final_layernorm(features)
        n, height, width, _ = pixels.shape
        grid = features.reshape(n, height // patch, width // patch, -1)
        h = pixel_shuffle(grid, fold, self.args.ps_version == "v1")
        h = h.reshape(n, -1, h.shape[-1])
        for layer in self.mlp1:
            h = layer(h)
        return h

    def embed(self, inputs: mx.array, features: mx.array | None = None) -> mx.array:
        """Token embeddings, the image tokens' replaced by `features` in order (or, for image
        keys, by their bound rows)."""
        return embed_with_images(inputs, self.language_model.backbone.embeddings,
                                 self.args.img_context_token_id, features, self._bound)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None,
                 spans: Sequence[tuple[int, int]] = (),
                 features: mx.array | None = None) -> mx.array:
        """Logits; `spans` are ignored: Nemotron-H attends causally over image tokens."""
        return self.forward_hidden(inputs, cache, spans, features)[0]

    def forward_hidden(self, inputs: mx.array, cache: list[Any] | None = None,
                       spans: Sequence[tuple[int, int]] = (),
                       features: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """(logits, final hidden states after norm_f), the latter for the MTP head."""
        lm = self.language_model
        h = self.embed(inputs, features)
        caches = iter(cache) if cache is not None else None
        for layer in lm.backbone.layers:
            own = next(caches) if caches is not None and layer.kind != "-" else None
            h = layer(h, own)
        h = lm.backbone.norm_f(h)
        return lm._logits(h), h

    def draft_embed(self, ids: mx.array) -> mx.array:
        """Token embeddings for the MTP head: an image position gets its placeholder token's
        embedding, as mlx-vlm's drafter embeds input_ids (not the image features)."""
        ids = mx.where(ids >= IMAGE_KEY_BASE, self.args.img_context_token_id, ids)
        return self.language_model.backbone.embeddings(ids)

    def fit_weights(self, weights: dict[str, mx.array]) -> None:
        self.language_model.fit_weights(weights, "language_model.")

    def draft_head(self) -> nn.Module | None:
        return self.language_model.draft_head()


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The language model's own sanitising under its prefix; what images never use (_DROPPED)
    is not loaded (create keeps it in the store)."""
    prefix = "language_model."
    weights = {prefix + k if k.startswith("mtp.") else k: v for k, v in weights.items()}
    language = text.sanitize({k[len(prefix):]: v for k, v in weights.items()
                              if k.startswith(prefix)})
    out = {prefix + k: v for k, v in language.items()}
    for key, value in weights.items():
        if key.startswith(prefix) or key.startswith(_DROPPED):
            continue
        out[key.removeprefix("vision_projector.")] = value
    return out


def optional_tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The language model's MTP head, under its prefix (see nemotron_h's)."""
    return {f"language_model.{k}": v for k, v in text.optional_tensor_shapes(args.text).items()}


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The language model's, RADIO's and the projector's tensors (PyTorch layout)."""
    shapes = {f"language_model.{k}": v for k, v in text.tensor_shapes(args.text).items()}
    shapes.update(radio.tensor_shapes(args.vision, "vision_model.radio_model."))
    wide = args.vit_width * args.shuffle ** 2
    shapes.update({"mlp1.0.weight": (wide,),
                   "mlp1.1.weight": (args.projector_hidden_size, wide),
                   "mlp1.3.weight": (args.text.hidden_size, args.projector_hidden_size)})
    if args.vision_final_layernorm:
        shapes.update({"vision_final_layernorm.weight": (args.vit_width,),
                       "vision_final_layernorm.bias": (args.vit_width,)})
    return shapes

