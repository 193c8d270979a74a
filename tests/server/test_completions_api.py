"""Fill-in-the-middle, the `template` override and /v1/completions, on scripted models.

`me/coder` says "Hello world" whatever it is asked, but a prompt that already ends in "Hello"
makes it continue with " world" only. Its Modelfile TEMPLATE writes `.Suffix` last, so a suffix
of "Hello" changes the answer: proof that the suffix reached the prompt.
"""

from __future__ import annotations

import ollama
import openai
import pytest
from scripted_model import PLAIN_TEMPLATE, serve_scripted_models

FIM_TEMPLATE = "<PRE>{{ .Prompt }}<MID>{{ .Suffix }}"


@pytest.fixture(scope="module")
def url(tmp_path_factory, make_checkpoint):
    models = {"me/coder": (["Hello", " world"], PLAIN_TEMPLATE, FIM_TEMPLATE),
              "me/plain": (["Hello", " world"], PLAIN_TEMPLATE)}
    with serve_scripted_models(tmp_path_factory.mktemp("home"), make_checkpoint,
                               models) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url, timeout=120)


def test_suffix_fills_the_templates_suffix(client):
    assert "insert" in client.show("me/coder").capabilities
    assert client.generate(model="me/coder", prompt="def f():").response == "Hello world"
    filled = client.generate(model="me/coder", prompt="def f():", suffix="Hello")
    assert filled.response == " world"


def test_suffix_for_a_model_without_insert_is_refused(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="me/plain", prompt="x", suffix="y")
    assert caught.value.status_code == 400 and "does not support insert" in caught.value.error


def test_template_override_replaces_the_models_template(client):
    assert client.generate(model="me/plain", prompt="hi").response == "Hello world"
    again = client.generate(model="me/plain", prompt="hi", template="{{ .Prompt }}Hello")
    assert again.response == " world"
    with pytest.raises(ollama.ResponseError) as caught:
        client.generate(model="me/plain", prompt="hi", template="{{ .Nope }}")
    assert caught.value.status_code == 400


def test_openai_completions_suffix_lists_echo_and_stream(url):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="ferry", timeout=120)
    done = api.completions.create(model="me/coder", prompt="def f():", suffix="Hello",
                                  max_tokens=10)
    assert done.object == "text_completion" and done.choices[0].text == " world"
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 1
    many = api.completions.create(model="me/plain", prompt=["a", "b"], echo=True)
    assert [c.text for c in many.choices] == ["aHello world", "bHello world"]
    assert [c.index for c in many.choices] == [0, 1]
    chunks = list(api.completions.create(model="me/plain", prompt="a", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello world"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_completions_legacy_logprobs(url):
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="ferry", timeout=120)
    done = api.completions.create(model="me/plain", prompt="a", logprobs=2)
    logprobs = done.choices[0].logprobs
    assert logprobs.tokens == ["Hello", " world"] and logprobs.text_offset == [0, 5]
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert [len(top) for top in logprobs.top_logprobs] == [2, 2]
