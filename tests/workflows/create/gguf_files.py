"""Small GGUF files written with the `gguf` package (the reference writer), for tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}"


def write_gguf(path: Path, split_max_tensors: int = 0, tensors: int = 3) -> Path:
    """A llama-architecture GGUF with a big vocabulary array and a NaN-valued key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama", split_max_tensors=split_max_tensors)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_file_type(15)  # Q4_K_M
    writer.add_chat_template(TEMPLATE)
    writer.add_token_list([f"tok{i}" for i in range(5000)])
    writer.add_array("llama.rope.freqs", [1.0, 2.0, 3.0])
    writer.add_float32("llama.test.nan", float("nan"))
    writer.add_array("llama.test.inf_array", [1.0, float("inf")])
    writer.add_uint64("llama.test.big", 2**63 + 5)
    for i in range(tensors):
        writer.add_tensor(f"blk.{i}.weight", np.full((4, 8 + i), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
