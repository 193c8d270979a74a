"""A checkpoint wide enough that quantizing it takes seconds (for the cancellation test)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

WIDE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 4096, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 256,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory):
    """~33M parameters of bf16 noise in the llama layout, written without the fixture script."""
    from workflows.create.validate import expected_shapes

    out = tmp_path_factory.mktemp("wide")
    (out / "config.json").write_text(json.dumps(WIDE_CONFIG))
    shapes = expected_shapes(WIDE_CONFIG)
    rng = np.random.default_rng(0)
    header, offset, arrays = {}, 0, []
    for name, shape in shapes.items():
        bits = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32) >> 16
        arrays.append(bits.astype(np.uint16))
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + arrays[-1].nbytes]}
        offset += arrays[-1].nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for array in arrays:
            fh.write(array.tobytes())
    return out
