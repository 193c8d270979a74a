"""Tool loops and reasoning through the official clients, on scripted fixture models.

`me/agent` reasons, says a few words, then calls two tools; its template renders tools,
previous calls and thinking, and skips reasoning when `enable_thinking` is false (the prompt
then ends in `</think>`, so the scripted model goes straight to the answer). `me/stubborn`
reasons whatever it is told and its template has no switch, so `think: false` must strip it.
`me/plain` neither reasons nor renders tools.
"""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest
from scripted_model import PLAIN_TEMPLATE, THINKING_TOOLS_TEMPLATE, serve_scripted_models

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CET = '{"name": "get_time", "arguments": {"zone": "CET"}}'
AGENT = ["<think>", "The user", " wants weather", "</think>", "Let me", " check", ".",
         "<tool_call>", PARIS, "</tool_call>", "\n<tool_call>", CET, "</tool_call>\n"]
STUBBORN = ["<think>", "Hmm", "</think>", "Hello", " there"]
STUBBORN_TEMPLATE = PLAIN_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}{# <think> #}")
# A template that opens the reasoning block itself (as thinking-only models' templates do).
OPENED_TEMPLATE = PLAIN_TEMPLATE.replace("'<|im_start|>assistant\\n'",
                                         "'<|im_start|>assistant\\n<think>'")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} tool",
    "parameters": {"type": "object", "properties": {arg: {"type": "string"}}}}}
    for name, arg in (("get_weather", "city"), ("get_time", "zone"))]
QUESTION = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory, make_checkpoint):
    models = {"me/agent": (AGENT, THINKING_TOOLS_TEMPLATE),
              "me/stubborn": (STUBBORN, STUBBORN_TEMPLATE),
              "me/plain": (["Hello", " world"], PLAIN_TEMPLATE),
              "me/opened": (["<think>", "Pondering", "</think>", "Answer"], OPENED_TEMPLATE)}
    with serve_scripted_models(tmp_path_factory.mktemp("home"), make_checkpoint,
                               models) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url, timeout=120)


def test_show_and_chat_agree_on_capabilities(client):
    assert {"tools", "thinking"} <= set(client.show("me/agent").capabilities)
    plain = set(client.show("me/plain").capabilities)
    assert "thinking" not in plain and "tools" not in plain
    assert client.chat(model="me/agent", messages=QUESTION, think=True).message.thinking


def test_tools_to_a_model_without_tool_support_are_refused(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="me/plain", messages=QUESTION, tools=TOOLS)
    assert caught.value.status_code == 400 and "does not support tools" in caught.value.error


def test_think_to_a_model_that_cannot_reason_is_refused(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="me/plain", prompt="hi", think=True)
    assert caught.value.status_code == 400 and "does not support thinking" in caught.value.error


def test_chat_splits_thinking_content_and_numbered_calls(client):
    reply = client.chat(model="me/agent", messages=QUESTION, tools=TOOLS, think=True)
    assert reply.message.thinking == "The user wants weather"
    assert reply.message.content == "Let me check."
    calls = reply.message.tool_calls
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_streamed_thinking_text_and_each_call_arrive_as_separate_chunks(url):
    body = {"model": "me/agent", "messages": QUESTION, "tools": TOOLS, "think": True}
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=120) as response:
        chunks = [json.loads(line) for line in response.iter_lines() if line]
    kinds = []
    for chunk in chunks[:-1]:
        message = chunk["message"]
        if message.get("thinking"):
            kinds.append("thinking")
        if message.get("tool_calls"):
            kinds += [f"call{c['function']['index']}" for c in message["tool_calls"]]
        if message["content"]:
            kinds.append("text")
    assert kinds == ["thinking"] * 2 + ["text"] * 3 + ["call0", "call1"]
    assert chunks[-1]["done"] and not chunks[-1]["message"].get("tool_calls")


def test_think_false_skips_reasoning_through_the_template(client):
    reply = client.chat(model="me/agent", messages=QUESTION, think=False)
    assert not reply.message.thinking
    assert reply.message.content.startswith("Let me check.")
    generated = client.generate(model="me/agent", prompt="weather?", think=False)
    assert not generated.thinking and generated.response.startswith("Let me check.")


def test_think_false_strips_reasoning_the_template_cannot_switch_off(client):
    reply = client.chat(model="me/stubborn", messages=QUESTION, think=False)
    assert reply.message.content == "Hello there" and not reply.message.thinking
    shown = client.generate(model="me/stubborn", prompt="hi", think=True)
    assert shown.thinking == "Hmm" and shown.response == "Hello there"


def test_a_whole_tool_loop_from_the_ollama_client_renders(client):
    """The client drops empty content; previous calls, thinking and results go back in."""
    first = client.chat(model="me/agent", messages=QUESTION, tools=TOOLS, think=True)
    loop = [*QUESTION, first.message,
            {"role": "tool", "tool_name": "get_weather", "content": "sunny"},
            {"role": "tool", "tool_name": "get_time", "content": "12:00"}]
    again = client.chat(model="me/agent", messages=loop, tools=TOOLS)
    assert again.done and again.message.tool_calls


def test_assistant_turn_without_content_is_normalised(url):
    call = {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*QUESTION, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "rain"}]
    response = httpx.post(f"{url}/api/chat", json={
        "model": "me/agent", "messages": messages, "tools": TOOLS, "stream": False},
        timeout=120)
    assert response.status_code == 200, response.text


def test_openai_tool_loop_with_ids_and_reasoning(url):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="ferry", timeout=120)
    first = api.chat.completions.create(model="me/agent", messages=QUESTION, tools=TOOLS,
                                        reasoning_effort="high")
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning"] == "The user wants weather"
    ids = [call.id for call in message.tool_calls]
    assert len(set(ids)) == 2 and all(ids)
    loop = [*QUESTION, message.model_dump(exclude_none=True),
            *({"role": "tool", "tool_call_id": i, "content": "ok"} for i in ids)]
    again = api.chat.completions.create(model="me/agent", messages=loop, tools=TOOLS)
    assert again.choices[0].message.tool_calls
    stream = api.chat.completions.create(model="me/agent", messages=QUESTION, tools=TOOLS,
                                         stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = [tc.index for d in deltas for tc in (d.tool_calls or [])]
    assert streamed == [0, 1]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == \
        "The user wants weather"


def test_openai_tools_to_a_plain_model_is_a_400(url):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="ferry", timeout=120)
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        api.chat.completions.create(model="me/plain", messages=QUESTION, tools=TOOLS)


def test_reasoning_opened_by_the_template_is_still_thinking(client):
    reply = client.chat(model="me/opened", messages=QUESTION)
    assert (reply.message.thinking, reply.message.content) == ("Pondering", "Answer")
    hidden = client.chat(model="me/opened", messages=QUESTION, think=False)
    assert (hidden.message.thinking, hidden.message.content) == (None, "Answer")


def test_a_json_answer_from_a_reasoning_model_is_all_content(client):
    """The grammar writes JSON from the first token, even where the template opened <think>."""
    reply = client.chat(model="me/opened", messages=QUESTION, format="json",
                        options={"num_predict": 5})
    assert reply.message.content.startswith(("{", "[")) and not reply.message.thinking
