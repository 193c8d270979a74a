"""Reading tool calls out of a model's answer, in the shapes chat templates teach."""

from __future__ import annotations

from server.tool_calls import ToolCall, parse_tool_calls, tool_names

NAMES = {"get_weather"}


def test_tagged_calls_are_read_and_removed_from_the_text():
    text = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    assert parse_tool_calls(text, NAMES) == ("Checking.",
                                             [ToolCall("get_weather", {"city": "Paris"})])


def test_mistral_and_bare_json_calls_are_read():
    mistral = '[TOOL_CALLS] [{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]'
    assert parse_tool_calls(mistral, NAMES)[1] == [ToolCall("get_weather", {"city": "Oslo"})]
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert parse_tool_calls(llama, NAMES) == ("", [ToolCall("get_weather", {"city": "Rome"})])


def test_json_that_names_no_offered_tool_stays_text():
    text = '{"name": "rm_rf", "arguments": {}}'
    assert parse_tool_calls(text, NAMES) == (text, [])
    assert parse_tool_calls('{"name": "get_weather", "arguments": {}}', set())[1] == []
    assert parse_tool_calls("just words", NAMES) == ("just words", [])


def test_tool_names_come_from_the_request_tools():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
             {"type": "function"}, "junk"]
    assert tool_names(tools) == {"get_weather": {}}
    assert tool_names(None) == {}
