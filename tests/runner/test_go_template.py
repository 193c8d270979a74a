"""Modelfile TEMPLATEs in Go's template language: the constructs Ollama's library templates use
(tools, tool calls, thinking, variables, functions), rendered the way Ollama renders them."""

from __future__ import annotations

import datetime
import json

import pytest

from runner.go_template import GoTemplate, TemplateError, go_json

# A tool-calling chat template in the style of Ollama's library templates (written for this test):
# indexed range, a `$last` computed with len/slice, `and` over root and local values, tools as
# JSON, tool calls with their arguments, tool results, thinking and the think switch.
TOOLS_TEMPLATE = """
{{- if or .System .Tools }}<|system|>
{{- if .System }}{{ .System }}{{ end }}
{{- if .Tools }}
You may call these tools:
{{- range .Tools }}
{{ . }}
{{- end }}{{ end }}<|end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|user|>{{ .Content }}<|end|>
{{ else if eq .Role "assistant" }}<|assistant|>
{{- if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}
{{- if .ToolCalls }}{{ range .ToolCalls }}<call>{"name": "{{ .Function.Name }}", \
"arguments": {{ .Function.Arguments }}}</call>{{ end }}
{{- else }}{{ .Content }}{{ end }}
{{- if not $last }}<|end|>
{{ end }}
{{- else if eq .Role "tool" }}<|tool|>{{ .ToolName }}: {{ .Content }}<|end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|assistant|>
{{- if and $.IsThinkSet (not $.Think) }}<think></think>{{ end }}
{{- end }}
{{- end }}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & later",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "the city"},
                                  "unit": {"type": ["string", "null"], "enum": ["c", "f"]}}}}}


def test_a_tool_calling_template_renders_tools_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "use the tool",
         "tool_calls": [{"function": {"name": "get_weather",
                                      "arguments": {"unit": "c", "city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    out = GoTemplate(TOOLS_TEMPLATE).render(messages, tools=[WEATHER], think=False)
    # Go's json.Marshal: api.Tool's field order, omitempty, <>& escaped; arguments in the order
    # the client sent them.
    tool_json = ('{"type":"function","function":{"name":"get_weather","description":'
                 '"Weather \\u003cnow\\u003e \\u0026 later","parameters":{"type":"object",'
                 '"required":["city"],"properties":{"city":{"type":"string","description":'
                 '"the city"},"unit":{"type":["string","null"],"enum":["c","f"]}}}}}')
    assert out == (
        "<|system|>Be brief.\nYou may call these tools:\n" + tool_json + "<|end|>\n"
        "<|user|>Weather in Paris?<|end|>\n"
        "<|assistant|><think>use the tool</think><call>{\"name\": \"get_weather\", "
        "\"arguments\": {\"unit\":\"c\",\"city\":\"Paris\"}}</call><|end|>\n"
        "<|tool|>get_weather: sunny<|end|>\n"
        "<|assistant|><think></think>")


def test_think_flags_follow_the_request():
    template = GoTemplate("{{ range .Messages }}{{ .Content }}{{ end }}"
                          "|{{ .Think }}|{{ .IsThinkSet }}")
    user = [{"role": "user", "content": "hi"}]
    assert template.render(user) == "hi|false|false"
    assert template.render(user, think=True) == "hi|true|true"
    assert template.render(user, think="high") == "hi|true|true"
    assert template.render(user, think=False) == "hi|false|true"


def test_consecutive_messages_of_one_role_merge_but_tool_results_do_not():
    template = GoTemplate("{{ range .Messages }}[{{ .Role }}:{{ .Content }}]{{ end }}")
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert template.render(messages) == "[user:a\n\nb][tool:1][tool:2]"


@pytest.mark.parametrize(("source", "expected"), [
    ('{{ $x := "a" }}{{ $x = "b" }}{{ $x }}', "b"),
    ("{{ range $k, $v := .M }}{{ $k }}={{ $v }};{{ end }}", "z=1;a=2;"),
    ("{{ range 3 }}{{ . }}{{ end }}", "012"),
    ("{{ range .Empty }}x{{ else }}none{{ end }}", "none"),
    ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}"
     "{{ . }}{{ end }}", "13"),
    ("{{ with .M }}{{ .a }}{{ else }}no{{ end }}", "2"),
    ("{{ with .Empty }}x{{ else with .M }}{{ .z }}{{ end }}", "1"),
    ("{{ if .Empty }}a{{ else if .L }}b{{ else }}c{{ end }}", "b"),
    ("{{ index .L 1 }} {{ index .M \"a\" }} {{ len .L }} {{ slice .L 1 3 }}", "2 2 4 [2 3]"),
    ("{{ (index .Msgs 0).Role }} {{ $.Msgs | len }}", "user 1"),
    ('{{ printf "%s-%d-%q" "a" 7 "b" }} {{ print 1 2 "x" }}', 'a-7-"b" 1 2x'),
    ('{{ eq "b" "a" "b" }} {{ ne 1 2 }} {{ lt 1 2 }} {{ ge 1 2 }} {{ not .Empty }}',
     "true true true false true"),
    ('{{ or .Empty "fallback" }} {{ and .L .Empty }}', "fallback []"),
    ('{{ "}}" }}{{/* a comment with "quotes" and }} braces */}}', "}}"),
    ("a  {{- 1 -}}  b", "a1b"),
    ("{{ json .M }}", '{"z":1,"a":2}'),
    ("{{ `raw \\n` }}", "raw \\n"),
])
def test_go_template_language(source, expected):
    # `or`/`and` short-circuit: `and .L .Empty` returns .Empty (an empty list prints as []).
    root = {"M": {"z": 1, "a": 2}, "L": [1, 2, 3, 4], "Empty": [],
            "Msgs": [{"role": "user", "content": "x"}]}
    template = GoTemplate(source + "{{ .Response }}")
    state_root = {**root, "Response": ""}
    assert template._execute(state_root, stop_at_response=False) == expected


def test_and_or_do_not_evaluate_what_they_skip():
    template = GoTemplate("{{ if and .Missing (index .Missing 5) }}x{{ else }}ok{{ end }}"
                          "{{ .Response }}")
    assert template._execute({"Response": ""}, stop_at_response=False) == "ok"


def test_date_functions_are_todays_and_yesterdays_date():
    template = GoTemplate("{{ range .Messages }}{{ end }}{{ currentDate }} {{ yesterdayDate }}")
    today = datetime.date.today()
    assert template.render([{"role": "user", "content": "x"}]) == (
        f"{today.isoformat()} {(today - datetime.timedelta(days=1)).isoformat()}")


def test_a_prompt_form_template_gets_response_appended_and_stops_there():
    # Ollama appends {{ .Response }} to a template that has neither .Messages nor .Response.
    template = GoTemplate("<s>{{ .Prompt }}</s>")
    assert template.render([{"role": "user", "content": "a"}, {"role": "assistant",
                                                               "content": "b"},
                            {"role": "user", "content": "c"}]) == "<s>a</s>b<s>c</s>"


def test_fill_in_the_middle_renders_prompt_and_suffix_once():
    template = GoTemplate("{{ if .Suffix }}<PRE>{{ .Prompt }}<SUF>{{ .Suffix }}<MID>"
                          "{{ else }}{{ .Prompt }}{{ end }}")
    assert template.render([{"role": "user", "content": "def f("}],
                           suffix="return 1") == "<PRE>def f(<SUF>return 1<MID>"


def test_openai_style_string_arguments_become_an_object():
    template = GoTemplate("{{ range .Messages }}{{ range .ToolCalls }}"
                          "{{ range $k, $v := .Function.Arguments }}{{ $k }}={{ $v }};{{ end }}"
                          "{{ end }}{{ end }}")
    calls = [{"function": {"name": "f", "arguments": json.dumps({"city": "Oslo", "n": 2})}}]
    assert template.render([{"role": "assistant", "content": "", "tool_calls": calls}]) == (
        "city=Oslo;n=2;")


@pytest.mark.parametrize(("source", "message"), [
    ("{{ .Role.Name }}{{ range .Messages }}{{ end }}", "can't read field"),
    ("{{ $nope }}{{ range .Messages }}{{ end }}", "variable \\$nope is not defined"),
    ("{{ break }}{{ range .Messages }}{{ end }}", "outside a range"),
])
def test_runtime_errors_name_the_problem(source, message):
    with pytest.raises(TemplateError, match=message):
        GoTemplate(source.replace(".Role", ".System")).render(
            [{"role": "system", "content": "s"}])


def test_nesting_is_bounded():
    with pytest.raises(TemplateError, match="deeper"):
        GoTemplate("{{ if .X }}" * 100 + "{{ end }}" * 100)


def test_go_json_escapes_as_go_does():
    assert go_json({"a": "<&>\u2028", "b": [1, "é"]}) == (
        '{"a":"\\u003c\\u0026\\u003e\\u2028","b":[1,"é"]}')


@pytest.mark.parametrize(("source", "message"), [
    ("{{ range 100000000 }}{{ end }}", "steps"),
    ('{{ $s := "ab" }}{{ range 40 }}{{ $s = print $s $s }}{{ end }}', "string over"),
    ("{{ range 3000000 }}xxxxxxxxxx{{ end }}", "renders more than|steps"),
])
def test_a_request_template_cannot_run_away(source, message):
    # /api/generate takes a template with the request: rendering is bounded in time and size
    with pytest.raises(TemplateError, match=message):
        GoTemplate(source + "{{ range .Messages }}{{ end }}").render(
            [{"role": "user", "content": "x"}])


def test_printf_widths_past_three_digits_stay_text():
    template = GoTemplate('{{ printf "%5d|%99999999d" 7 }}{{ range .Messages }}{{ end }}')
    assert template.render([{"role": "user", "content": "x"}]) == "    7|%99999999d"
