"""The architecture registry and model construction from config.json."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from runner.load import LoadError, build_model
from runner.models import model_module, model_types, module_for_architecture

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
          "unknown_key_from_a_newer_transformers": True,
          # nemotron_h's (the others ignore them): one Mamba2 layer, one attention layer
          "hybrid_override_pattern": "M*", "mamba_num_heads": 4, "mamba_head_dim": 16,
          "ssm_state_size": 8}


def _generates(model_type: str) -> bool:
    module = model_module(model_type)
    return bool(set(module.ARCHITECTURES) - set(getattr(module, "EMBEDDING_ARCHITECTURES", ())))


# Text decoders share the config keys above; encoders' and vision models' configs are tested
# with their checkpoints (tests/runner/test_embedding_parity.py, test_gemma3_vision*.py).
DECODERS = [t for t in model_types()
            if _generates(t) and not getattr(model_module(t), "VISION_ARCHITECTURES", ())]


def test_every_architecture_file_is_found_by_its_model_type():
    assert {"llama", "qwen3"} <= set(model_types())
    for model_type in model_types():
        module = model_module(model_type)
        assert module.ARCHITECTURES and callable(module.tensor_shapes)
        for arch in module.ARCHITECTURES:
            assert module_for_architecture(arch) is module


@pytest.mark.parametrize("model_type", DECODERS)
def test_each_module_builds_from_config_ignoring_unknown_keys(model_type):
    module = model_module(model_type)
    args = module.ModelArgs.from_dict({**CONFIG, "model_type": model_type})
    shapes = module.tensor_shapes(args)
    embeddings = [shape for name, shape in shapes.items() if "embed" in name]
    assert embeddings == [(100, 64)]  # the vocabulary by the hidden size, whatever its name


@pytest.mark.parametrize("model_type", DECODERS)
def test_model_found_by_architecture_when_model_type_is_missing(model_type):
    config = {**CONFIG, "architectures": [model_module(model_type).ARCHITECTURES[0]]}
    model, module = build_model(config)
    assert module.__name__.endswith(model_type)
    assert len(model.layers) == 2


def test_unknown_architecture_is_a_clear_load_error():
    with pytest.raises(LoadError, match="not supported"):
        build_model({**CONFIG, "model_type": "mamba"})
    with pytest.raises(LoadError, match="not supported"):
        build_model({**CONFIG, "architectures": ["MambaForCausalLM"]})


def _stacked(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-expert checkpoint tensors as create stacks them: `<group>.<proj>.weight`."""
    out: dict[str, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    for name, shape in shapes.items():
        match = re.match(r"^(.+\.experts)\.(\d+)\.(\w+\.weight)$", name)
        if match is None:
            out[name] = shape
            continue
        key = f"{match[1]}.{match[3]}"
        counts[key] = counts.get(key, 0) + 1
        out[key] = (counts[key], *shape)
    return out


@pytest.mark.parametrize("model_type", DECODERS)
def test_tensor_shapes_are_exactly_the_model_parameters(model_type):
    """What create validates is what the runner loads: same names, same shapes (after create
    stacks experts and the module's `sanitize` moves stored layouts into the model's)."""
    module = model_module(model_type)
    config = {**CONFIG, "model_type": model_type, "head_dim": 16, "tie_word_embeddings": False,
              "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    args = module.ModelArgs.from_dict(config)
    params = {k: tuple(v.shape) for k, v in tree_flatten(module.Model(args).parameters())}
    stored = {k: mx.zeros(shape) for k, shape in _stacked(module.tensor_shapes(args)).items()}
    loaded = module.sanitize(stored) if hasattr(module, "sanitize") else stored
    assert {k: tuple(v.shape) for k, v in loaded.items()} == params
