"""Random-weight Nemotron-H VL checkpoints (NemotronH_Nano_VL_V2 layout): nemotron_fixture.py's
language model under `llm_config`, a tiny RADIO tower (4-pixel patches, 16-pixel tiles, a 16x16
position grid resized per tile, two summary tokens and two registers), the `mlp1` projector,
float32 safetensors, and the tiny llama tokenizer with `<img>`, `</img>` and `<image>` added
after its 2048 entries (the language model's vocabulary is padded to 2052 to hold them)."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from nemotron_fixture import MTP_CONFIG, TINY_CONFIG, TOKENIZER_FILES, _values, mtp_tensors
from safetensors.numpy import save_file

from runner.models import nemotron_h_vl

IMAGE_TOKENS = {"<img>": 2048, "</img>": 2049, "<image>": 2050}
VL_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronH_Nano_VL_V2"],
    "model_type": "NemotronH_Nano_VL_V2",
    "llm_config": {**TINY_CONFIG, "vocab_size": 2052, "torch_dtype": "float32"},
    "vision_config": {"model_type": "radio", "version": "radio_v2.5-h", "hidden_size": 32,
                      "num_hidden_layers": 2, "num_attention_heads": 2,
                      "intermediate_size": 64, "patch_size": 4, "max_resolution": 64,
                      "args": {"cpe_max_size": 64, "register_multiple": 4,
                               "teachers": [{"name": "clip"}, {"name": "siglip"}]}},
    "force_image_size": 16, "patch_size": 4, "downsample_ratio": 0.5, "ps_version": "v2",
    "projector_hidden_size": 64, "vit_hidden_size": 32, "use_thumbnail": True,
    "img_context_token_id": IMAGE_TOKENS["<image>"], "img_start_token": "<img>",
    "img_end_token": "</img>", "norm_mean": [0.48145466, 0.4578275, 0.40821073],
    "norm_std": [0.26862954, 0.26130258, 0.27577711], "torch_dtype": "float32",
}
PREPROCESSOR = {"image_size": 16, "max_num_tiles": 12, "use_thumbnail": True,
                "norm_mean": VL_CONFIG["norm_mean"], "norm_std": VL_CONFIG["norm_std"]}


def _tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name.startswith("language_model."):
        return _values(name, shape, rng).astype(np.float32)
    if name.endswith("norm_mean"):
        return np.full(shape, 0.5, np.float32)
    if name.endswith("norm_std") or name.endswith(("norm1.weight", "norm2.weight", "0.weight")):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    scale = 0.5 if name.endswith(("pos_embed", "cls_token.token")) else 0.1
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _tokenizer_with_image_tokens(source: Path, out: Path) -> None:
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["added_tokens"] += [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for text, i in IMAGE_TOKENS.items()]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))


def write_nemotron_vl_checkpoint(out: Path, tokenizer_dir: Path, mtp: str | None = None,
                                 embed_scale: float = 1.0, **changes: Any) -> Path:
    """The checkpoint dir; every tensor nemotron_h_vl.tensor_shapes lists, and with `mtp` the
    language model's MTP head (`language_model.mtp.*`, see nemotron_fixture.mtp_tensors)."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**VL_CONFIG, **changes}
    if mtp:
        config["llm_config"] = {**config["llm_config"], **MTP_CONFIG}
    args = nemotron_h_vl.ModelArgs.from_dict(config)
    tensors = {name: _tensor(name, shape)
               for name, shape in nemotron_h_vl.tensor_shapes(args).items()}
    tensors["language_model.backbone.embeddings.weight"] *= embed_scale
    if mtp:
        head = mtp_tensors(config["llm_config"], mtp, np.random.default_rng(7),
                           "language_model.")
        tensors.update({k: v.astype(np.float32) for k, v in head.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    _tokenizer_with_image_tokens(tokenizer_dir, out)
    return out
