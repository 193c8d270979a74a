"""Splitting a streamed answer into reasoning, text and tool calls, however it is cut."""

from __future__ import annotations

from server.output_parser import Calls, OutputParser, Thinking, ThinkMode

ANSWER = ('<think>plan it</think>\n\nSure. <tool_call>{"name": "f", "arguments": {"x": 1}}'
          '</tool_call>')


def _run(parser: OutputParser, pieces: list[str]) -> list:
    out = [p for piece in pieces for p in parser.feed(piece)]
    return out + parser.finish()


def _merged(items: list) -> tuple[str, str, list]:
    thinking = "".join(i.text for i in items if isinstance(i, Thinking))
    text = "".join(i for i in items if isinstance(i, str))
    calls = [c for i in items if isinstance(i, Calls) for c in i.calls]
    return thinking, text, calls


def test_any_cut_of_the_answer_parses_the_same():
    for size in (1, 2, 3, 7, len(ANSWER)):
        pieces = [ANSWER[i:i + size] for i in range(0, len(ANSWER), size)]
        thinking, text, calls = _merged(_run(OutputParser(ThinkMode.SHOW, {"f"}), pieces))
        assert (thinking, text) == ("plan it", "Sure.")
        assert [(c.name, c.arguments, c.index) for c in calls] == [("f", {"x": 1}, 0)]


def test_a_call_is_emitted_when_its_closing_tag_arrives():
    parser = OutputParser(ThinkMode.OFF, {"f"})
    assert parser.feed('<tool_call>{"name": "f", "arguments": {}}') == []
    emitted = parser.feed("</tool_call>")
    assert isinstance(emitted[0], Calls) and emitted[0].calls[0].name == "f"


def test_hidden_reasoning_is_dropped_and_off_keeps_tags_as_text():
    assert _merged(_run(OutputParser(ThinkMode.HIDE, set()), [ANSWER]))[:2] == (
        "", "Sure. " + ANSWER.split("Sure. ")[1])
    assert _run(OutputParser(ThinkMode.OFF, set()), ["<think>a</think>b"]) == [
        "<think>a</think>b"]


def test_an_unknown_tool_name_stays_text_and_untagged_calls_are_read_whole():
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert _merged(_run(OutputParser(ThinkMode.OFF, {"f"}), [unknown])) == ("", unknown, [])
    bare = '{"name": "f", "parameters": {"x": 2}}'
    _, text, calls = _merged(_run(OutputParser(ThinkMode.OFF, {"f"}), list(bare)))
    assert text == "" and calls[0].arguments == {"x": 2}
