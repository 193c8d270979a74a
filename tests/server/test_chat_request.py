"""Request parsing for generate/chat: keep_alive durations, option merging, JSON formats."""

from __future__ import annotations

import json

import pytest

from registry.manifests import ModelConfig
from registry.names import Name
from server.api_errors import APIError
from server.chat_request import ModelDefaults, merge_options, parse_keep_alive, refuse_unsupported
from server.json_format import JSONFormat


def model(**fields) -> ModelDefaults:
    return ModelDefaults(Name.parse_valid("me/tiny"), "0" * 64, manifest=None,  # type: ignore
                         config=ModelConfig(**fields.pop("config", {})), **fields)


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), ("", None), (0, 0.0), (300, 300.0), (-1, -1.0), ("300", 300.0),
    ("5m", 300.0), ("1h30m", 5400.0), ("-1s", -1.0), ("1.5s", 1.5), ("250ms", 0.25),
])
def test_keep_alive_accepts_numbers_and_go_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m5", "5x", True, [1]])
def test_keep_alive_rejects_what_is_not_a_duration(value):
    with pytest.raises(APIError) as info:
        parse_keep_alive(value)
    assert info.value.status == 400


def test_request_options_win_over_model_parameters_and_unknown_ones_are_dropped():
    defaults = model(params={"temperature": 0.2, "stop": "<end>", "num_gpu": 99})
    merged = merge_options(defaults, {"temperature": 0.9, "seed": 3})
    assert merged == {"temperature": 0.9, "stop": ["<end>"], "seed": 3}


def test_images_for_a_text_only_model_are_refused_with_its_name():
    with pytest.raises(APIError, match='"me/tiny:latest" does not support images'):
        refuse_unsupported(model(), {}, has_images=True)
    with pytest.raises(APIError, match="does not support generate"):
        refuse_unsupported(model(config={"capabilities": ["embedding"]}), {}, has_images=False)


def test_formats_are_checked_and_passed_to_the_runner_as_json_or_a_schema():
    assert JSONFormat.parse("json").runner_value() == "json"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert JSONFormat.parse(schema).runner_value() == schema
    assert JSONFormat.parse(json.dumps(schema)).runner_value() == schema
    with pytest.raises(APIError, match="invalid JSON schema"):
        JSONFormat.parse({"type": 12})
    with pytest.raises(APIError, match="invalid format"):
        JSONFormat.parse("yaml")
