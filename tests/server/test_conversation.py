"""Messages normalised before any template sees them, whichever client sent them."""

from __future__ import annotations

import pytest

from server.api_errors import APIError
from server.conversation import normalise_messages


def test_a_tool_loop_from_any_client_comes_out_in_one_shape():
    messages = normalise_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "thinking": "look it up", "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"function": {"name": "get_time", "arguments": None}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "name": "get_time", "content": "noon"},
    ])
    assistant, first, second = messages[1:]
    assert assistant["content"] == "" and assistant["reasoning_content"] == "look it up"
    calls = assistant["tool_calls"]
    assert calls[0]["function"] == {"index": 0, "name": "get_weather",
                                    "arguments": {"city": "Oslo"}}
    assert calls[1]["function"]["arguments"] == {} and calls[1]["function"]["index"] == 1
    assert (first["tool_name"], first["name"]) == ("get_weather", "get_weather")
    assert second["tool_name"] == "get_time"


@pytest.mark.parametrize("bad", [
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
    {"role": "assistant", "tool_calls": "f()"},
    {"role": "user", "content": 3},
    {"content": "no role"},
])
def test_malformed_messages_are_a_400(bad):
    with pytest.raises(APIError) as caught:
        normalise_messages([bad])
    assert caught.value.status == 400
