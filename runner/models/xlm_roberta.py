"""XLM-RoBERTa (model_type "xlm-roberta"; XLMRobertaModel): BERT's encoder with RoBERTa's
positions, which start after the padding id (`padding_idx + 1`) and skip padding tokens, and a
single token type. The layers are BERT's (runner/models/bert.py), tensor names included.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from runner.models import bert

ARCHITECTURES = ("XLMRobertaModel",)
EMBEDDING_ARCHITECTURES = ARCHITECTURES
DEFAULT_POOLING = "cls"


@dataclass
class ModelArgs(bert.ModelArgs):
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1


def tensor_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    return bert.tensor_shapes(args)


class Model(bert.Model):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.padding_idx = args.pad_token_id
        self.max_tokens = args.max_position_embeddings - args.pad_token_id - 1

    def positions(self, ids: mx.array, mask: mx.array) -> mx.array:
        """RoBERTa's create_position_ids_from_input_ids: count real tokens from padding_idx+1;
        padding sits at padding_idx itself."""
        real = (ids != self.padding_idx).astype(mx.int32)
        return mx.cumsum(real, axis=1) * real + self.padding_idx


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    return bert.sanitize({k.removeprefix("roberta."): v for k, v in weights.items()})
