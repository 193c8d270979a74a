"""The architecture registry and model construction from config.json."""

from __future__ import annotations

import pytest

from runner.load import LoadError, build_model
from runner.models import ARCHITECTURES, get_model_module

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
          "unknown_key_from_a_newer_transformers": True,
          # nemotron_h's (the others ignore them): one Mamba2 layer, one attention layer
          "hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 16,
          "ssm_state_size": 8}


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_registry_matches_each_module(model_type):
    module = get_model_module(model_type)
    assert ARCHITECTURES[model_type] == module.ARCHITECTURES
    args = module.ModelArgs.from_dict({**CONFIG, "model_type": model_type})
    assert args.head_dim == 16 and args.num_key_value_heads == 2


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_model_found_by_architecture_when_model_type_is_missing(model_type):
    config = {**CONFIG, "architectures": [ARCHITECTURES[model_type][0]]}
    model, module = build_model(config)
    assert module.__name__.endswith(model_type)
    assert len(model.layers) == 2


def test_unknown_architecture_is_a_clear_load_error():
    with pytest.raises(LoadError, match="not supported"):
        build_model({**CONFIG, "model_type": "mamba"})
