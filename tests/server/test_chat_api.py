"""The chat API through the real runner: the official `ollama` and `openai` clients, /api/ps.

One model server and one runner process serve the whole module (a runner takes seconds to
start). The tiny model answers greedily, so streamed and non-streamed answers must agree.
"""

from __future__ import annotations

import time

import httpx
import ollama
import openai
import pytest
from conftest import runner_processes
from served_model import serve_tiny_model

QUESTION = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_checkpoint):
    with serve_tiny_model(tmp_path_factory.mktemp("home"), make_checkpoint) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url, timeout=120)


def test_ollama_generate_streamed_and_not_agree(client, served):
    whole = client.generate(model=served.model, prompt="hello there")
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.eval_count and whole.eval_count <= 8  # the model's PARAMETER num_predict
    assert whole.prompt_eval_count and whole.prompt_eval_duration
    assert whole.total_duration >= whole.eval_duration > 0
    assert whole.load_duration is not None and whole.created_at
    chunks = list(client.generate(model=served.model, prompt="hello there", stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.response for c in chunks) == whole.response
    assert chunks[-1].eval_count == whole.eval_count


def test_ollama_chat_streamed_and_not_agree(client, served):
    whole = client.chat(model=served.model, messages=QUESTION)
    assert whole.message.role == "assistant" and whole.done
    assert whole.eval_count and whole.total_duration
    chunks = list(client.chat(model=served.model, messages=QUESTION, stream=True))
    assert chunks[-1].done and chunks[-1].done_reason in ("stop", "length")
    assert "".join(c.message.content for c in chunks) == whole.message.content


def test_tools_for_a_model_whose_template_has_no_tools_are_refused(client, served):
    """The fixture's chat template ignores tools: Ollama answers 400, not a silent answer."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=served.model, messages=QUESTION, tools=tools)
    assert caught.value.status_code == 400 and "does not support tools" in caught.value.error


def test_request_options_override_the_model_defaults(client, served):
    short = client.generate(model=served.model, prompt="hello there",
                            options={"num_predict": 2})
    assert short.eval_count <= 2 and short.done_reason == "length"


def test_openai_client_streams_a_chat_completion(served):
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=120)
    whole = api.chat.completions.create(model=served.model, messages=QUESTION)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens > 0
    stream = api.chat.completions.create(model=served.model, messages=QUESTION, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and chunks[-1].usage.completion_tokens > 0
    assert [m.id for m in api.models.list()] == ["me/tiny:latest"]


def test_openai_errors_use_openai_shape(served):
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=60)
    with pytest.raises(openai.NotFoundError, match="not found"):
        api.chat.completions.create(model="me/missing", messages=QUESTION)


def test_ps_lists_the_loaded_model_with_its_compute_path(client, served):
    client.generate(model=served.model, prompt="hi", keep_alive="10m")
    (loaded,) = httpx.get(f"{served.url}/api/ps").json()["models"]
    assert loaded["name"] == "me/tiny:latest"
    assert loaded["compute"] in ("fused", "float32", "native")
    assert loaded["context_length"] > 0 and loaded["size"] > 0
    assert loaded["expires_at"] > time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    (listed,) = client.ps().models
    assert listed.model == "me/tiny:latest"


def test_images_are_refused_for_a_text_only_model(client, served):
    with pytest.raises(ollama.ResponseError, match="does not support images") as info:
        client.chat(model=served.model, messages=[{"role": "user", "content": "what is this",
                                                   "images": ["aGVsbG8="]}])
    assert info.value.status_code == 400


def test_unknown_model_is_404(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="me/missing", prompt="hi")
    assert info.value.status_code == 404


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "count", "ok"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


def test_random_weights_answer_schema_valid_json_in_one_pass_token_by_token(client, served):
    """The grammar masks the logits: no retries, no buffering, whatever the weights."""
    import json

    import jsonschema

    for seed in (1, 2, 3):
        options = {"temperature": 0.9, "seed": seed, "num_predict": 200}
        chunks = list(client.chat(model=served.model, messages=QUESTION, format=SCHEMA,
                                  stream=True, options=options))
        pieces = [c.message.content for c in chunks if c.message.content]
        assert chunks[-1].done_reason == "stop", "".join(pieces)
        assert len(pieces) > 5  # streamed as generated, not in one chunk at the end
        jsonschema.validate(json.loads("".join(pieces)), SCHEMA)
    answer = client.generate(model=served.model, prompt="json please", format="json",
                             options={"temperature": 0.9, "seed": 4, "num_predict": 300})
    assert answer.done_reason == "stop" and isinstance(json.loads(answer.response), dict | list)


def test_openai_response_format_json_schema_is_enforced(served):
    import json

    import jsonschema

    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=120)
    done = api.chat.completions.create(
        model=served.model, messages=QUESTION, seed=5, temperature=0.9, max_tokens=200,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA}})
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)


def test_a_runner_killed_mid_answer_fails_that_request_and_the_next_reloads(client, served):
    stream = client.generate(model=served.model, prompt="tell me a long story", stream=True,
                             options={"num_predict": 4000})
    next(stream)
    (runner,) = runner_processes()
    runner.kill()
    with pytest.raises(ollama.ResponseError, match="terminated"):
        for _ in stream:
            pass
    again = client.generate(model=served.model, prompt="hello there")
    assert again.done and runner_processes()[0].pid != runner.pid


def test_keep_alive_zero_unloads_after_the_request(client, served):
    client.generate(model=served.model, prompt="bye", keep_alive=0)
    deadline = time.monotonic() + 30
    while httpx.get(f"{served.url}/api/ps").json()["models"]:
        assert time.monotonic() < deadline, "runner still loaded"
        time.sleep(0.1)


def test_a_repeated_prompt_reports_its_whole_length_and_the_reuse_apart(served):
    body = {"model": served.model, "prompt": "count every token of this prompt " * 4,
            "stream": False, "options": {"num_predict": 2}}
    first = httpx.post(f"{served.url}/api/generate", json=body, timeout=120).json()
    again = httpx.post(f"{served.url}/api/generate", json=body, timeout=120).json()
    assert again["prompt_eval_count"] == first["prompt_eval_count"] > 20
    assert again["prompt_cached_count"] >= first["prompt_eval_count"] - 1
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=120)
    messages = [{"role": "user", "content": body["prompt"]}]
    usage = api.chat.completions.create(model=served.model, messages=messages,
                                        max_tokens=2).usage
    assert usage.prompt_tokens == first["prompt_eval_count"]
    assert usage.prompt_tokens_details.cached_tokens > 20


def test_logprobs_come_per_token_streamed_or_whole(client, served):
    whole = client.generate(model=served.model, prompt="hello there", logprobs=True,
                            top_logprobs=3)
    assert len(whole.logprobs) == whole.eval_count
    for entry in whole.logprobs:  # greedy: the chosen token is the most likely one
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
    chunks = list(client.chat(model=served.model, messages=QUESTION, stream=True,
                              logprobs=True))
    streamed = [e for c in chunks for e in (c.logprobs or [])]
    assert len(streamed) == chunks[-1].eval_count and len(chunks) > 2
    assert all(not e.top_logprobs for e in streamed)


def test_openai_logprobs_and_the_top_logprobs_limit(client, served):
    api = openai.OpenAI(base_url=f"{served.url}/v1", api_key="ferry", timeout=120)
    done = api.chat.completions.create(model=served.model, messages=QUESTION, logprobs=True,
                                       top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model=served.model, prompt="hi", logprobs=True, top_logprobs=21)
    assert caught.value.status_code == 400 and "top_logprobs" in caught.value.error


def test_generate_returns_context_and_accepts_it_back(client, served):
    first = client.generate(model=served.model, prompt="hello there")
    assert first.context and all(isinstance(t, int) for t in first.context)
    second = client.generate(model=served.model, prompt="and again", context=first.context)
    alone = client.generate(model=served.model, prompt="and again")
    assert second.prompt_eval_count == len(first.context) + alone.prompt_eval_count
    bad = httpx.post(f"{served.url}/api/generate", timeout=60, json={
        "model": served.model, "prompt": "x", "context": ["no"], "stream": False})
    assert bad.status_code == 400 and "context" in bad.json()["error"]


def test_a_long_answer_shifts_the_context_instead_of_stopping(served):
    body = {"model": served.model, "prompt": "hi", "raw": True, "stream": False,
            "options": {"num_ctx": 48, "num_predict": 80, "temperature": 0, "num_keep": 2}}
    shifted = httpx.post(f"{served.url}/api/generate", json=body, timeout=120).json()
    stopped = httpx.post(f"{served.url}/api/generate", json={**body, "shift": False},
                         timeout=120).json()
    assert (shifted["eval_count"], shifted["done_reason"]) == (80, "length")
    assert stopped["eval_count"] == 48 - stopped["prompt_eval_count"]
