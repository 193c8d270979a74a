"""Nemotron's output format (server/output_parser.py NemotronParser, server/tool_calls.py):
reasoning, XML and <TOOLCALL> JSON calls, fed with the piece boundaries in every place and
ended at every point (EOS, stop, length and a client leaving all end the stream early)."""

from __future__ import annotations

import pytest

from server.output_parser import (
    Calls,
    NemotronParser,
    OutputParser,
    Thinking,
    ThinkMode,
    parser_for,
)

XML = ("<think>\nplan: call get_weather</think>\n\nSure, checking.\n<tool_call>\n"
       "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
       "</parameter>\n</function>\n</tool_call>\n")
JSON = ('<think>plan</think>Sure, checking. <TOOLCALL>[{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}]</TOOLCALL>')
NO_CLOSE = ("<think>plan: call get_weather\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
NAMES = {"get_weather"}
EXPECTED_CALL = [("get_weather", {"city": "Paris", "days": 3})]


def _run(pieces: list[str], think: ThinkMode = ThinkMode.SHOW, names=NAMES
         ) -> tuple[str, str, list]:
    parser = NemotronParser(think, names)
    items = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
    thinking = "".join(i.text for i in items if isinstance(i, Thinking))
    text = "".join(i for i in items if isinstance(i, str))
    calls = [(c.name, c.arguments) for i in items if isinstance(i, Calls) for c in i.calls]
    return thinking, text, calls


@pytest.mark.parametrize(("answer", "thinking"), [(XML, "plan: call get_weather"),
                                                  (JSON, "plan"),
                                                  (NO_CLOSE, "plan: call get_weather")])
def test_whole_answers_split_into_reasoning_text_and_calls(answer: str, thinking: str):
    got_thinking, text, calls = _run([answer])
    assert got_thinking.strip() == thinking
    assert text == ("" if answer is NO_CLOSE else "Sure, checking.")
    assert calls == EXPECTED_CALL


@pytest.mark.parametrize("answer", [XML, JSON, NO_CLOSE])
def test_every_two_boundaries_parse_the_same(answer: str):
    whole = _run([answer])
    for i in range(len(answer) + 1):
        for j in range(i, len(answer) + 1, 3):
            assert _run([answer[:i], answer[i:j], answer[j:]]) == whole, (i, j)
    assert _run(list(answer)) == whole  # token by token


def _squeezed(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("answer", [XML, JSON, NO_CLOSE])
def test_a_stream_ended_anywhere_loses_and_repeats_nothing(answer: str):
    call_at = min(i for i in (answer.find("<tool_call>"), answer.find("<TOOLCALL>")) if i >= 0)
    for end in range(len(answer) + 1):
        prefix = answer[:end]
        thinking, text, calls = _run(list(prefix))
        assert (thinking, text, calls) == _run([prefix])
        if end <= call_at:  # everything but the think tags comes back, once
            bare = prefix.replace("<think>", "", 1).replace("</think>", "", 1)
            assert _squeezed(thinking + text) == _squeezed(bare), end
        else:  # a cut call is read (its closing tags forgiven) or kept (a cut tag in
            # reasoning is reasoning)
            assert calls or _squeezed(prefix[call_at:]) in _squeezed(thinking + text), end
            assert _squeezed(thinking).count("plan") == 1


def test_hidden_reasoning_is_dropped_and_unknown_calls_stay_text():
    assert _run([XML], ThinkMode.HIDE) == ("", "Sure, checking.", EXPECTED_CALL)
    parser = NemotronParser(ThinkMode.OFF, {"other"})
    items = parser.feed(XML.split("</think>")[1]) + parser.finish()
    assert not any(isinstance(i, Calls) for i in items)
    assert "<function=get_weather>" in "".join(i for i in items if isinstance(i, str))


def test_untagged_json_is_an_answer_not_a_call():
    assert _run(['{"name": "get_weather", "arguments": {}}'], ThinkMode.OFF) == (
        "", '{"name": "get_weather", "arguments": {}}', [])


def test_string_parameters_stay_text_and_json_literals_are_decoded():
    answer = ("<tool_call><function=get_weather><parameter=city>\nNew York\n</parameter>"
              "<parameter=opts>{\"units\": \"metric\"}</parameter><parameter=ok>true"
              "</parameter></function></tool_call>")
    assert _run([answer], ThinkMode.OFF)[2] == [
        ("get_weather", {"city": "New York", "opts": {"units": "metric"}, "ok": True})]


def test_xml_arguments_follow_the_declared_parameter_types():
    from server.tool_calls import tool_names

    properties = {"zip": {"type": "string"}, "days": {"type": "integer"}}
    names = tool_names([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": properties}}}])
    answer = ("<tool_call><function=get_weather><parameter=zip>\n01234\n</parameter>"
              "<parameter=days>3</parameter></function></tool_call>")
    assert _run([answer], ThinkMode.OFF, names)[2] == [("get_weather", {"zip": "01234",
                                                                        "days": 3})]
    # without the schema, "01234" is not JSON and stays text but "3" would be a number
    assert _run([answer.replace("01234", "123")], ThinkMode.OFF, names)[2][0][1]["zip"] == "123"


def test_the_parser_is_chosen_by_family_or_template():
    assert type(parser_for(ThinkMode.OFF, NAMES, "nemotron_h_vl")) is NemotronParser
    assert type(parser_for(ThinkMode.OFF, NAMES, "", "{{ '<TOOLCALL>' }}")) is NemotronParser
    assert type(parser_for(ThinkMode.OFF, NAMES, "llama", "<tool_call>")) is OutputParser
