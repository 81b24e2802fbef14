"""Structured outputs and tool calls through the official openai client, on a tiny random model:
a random model writes whatever the grammar lets it, so validity here is the grammar's doing."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.structured.conftest import openai_client
from tests.structured.schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sampled_output_matches_its_schema(client, name):
    schema = SCHEMAS[name]
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0.7, max_tokens=96, n=2, seed=7,
        response_format=_schema_format(schema))
    texts = [c.message.content for c in chat.choices]
    assert [c.finish_reason for c in chat.choices] == ["stop", "stop"], texts
    # the completions endpoint takes the same response_format
    completion = client.completions.create(
        model="tiny", prompt="JSON:", temperature=0.7, max_tokens=96, seed=11,
        extra_body={"response_format": _schema_format(schema)})
    assert completion.choices[0].finish_reason == "stop"
    texts.append(completion.choices[0].text)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_is_a_json_object(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.7,
                                          max_tokens=64, seed=3,
                                          response_format={"type": "json_object"})
    choice = chat.choices[0]
    # unbounded, so it may run out of tokens; what it wrote is the start of an object
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


def test_guided_regex_and_choice(client):
    regex = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-9]{2}"   # \d would take any Unicode digit
    for seed in range(3):
        out = client.completions.create(model="tiny", prompt="Date:", temperature=0.7,
                                        max_tokens=32, seed=seed,
                                        extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, out.choices[0].text), out.choices[0].text
    choices = ["yes", "no", "maybe not"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0,
                                          max_tokens=16, n=4, seed=5,
                                          extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in chat.choices)


def test_guided_grammar_lark_and_gbnf(client):
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    gbnf = 'root ::= "ab" [cd] "e"'
    for grammar, pattern in ((lark, r"\(\d{1,2}(\+\d{1,2})*\)"), (gbnf, r"ab[cd]e")):
        out = client.completions.create(model="tiny", prompt="x", temperature=0.7, max_tokens=48,
                                        seed=1, extra_body={"guided_grammar": grammar})
        if out.choices[0].finish_reason == "stop":
            assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("body, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "Invalid type: strin"),
    ({"guided_regex": "a(b"}, "unclosed group"),
    ({"guided_grammar": "start: foo"}, "unknown name"),
    ({"guided_json": {"type": "string", "pattern": "(?<=x)a"}}, "look-around"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "at most one of"),
    ({"guided_choice": []}, "choice must be a non-empty list"),
])
def test_bad_schema_or_grammar_is_a_400_with_the_engines_message(server, client, body, needle):
    for create in (lambda: client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                          max_tokens=8, extra_body=body),
                   lambda: client.completions.create(model="tiny", prompt="x", max_tokens=8,
                                                     extra_body=body)):
        with pytest.raises(openai.BadRequestError) as info:
            create()
        error = info.value.body
        assert needle in error["message"], error
        assert error["type"] == "invalid_request_error"
    server.assert_clean()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "pattern": "^UTC[+-][0-9]{1,2}$"}}}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(choice, names: set[str]):
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named_calls_match_the_parameters(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          tool_choice="required", temperature=0.8, n=4, seed=2,
                                          max_tokens=96)
    for choice in chat.choices:
        _check_calls(choice, {"get_weather", "get_time"})
        assert choice.message.content is None
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.8, n=3, seed=4, max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in chat.choices:
        _check_calls(choice, {"get_time"})


# A grammar for what a tool-trained model writes under tool_choice "auto": some text, then one
# tagged call (llguidance's %json embeds the parameter schema in the Lark grammar; x-guidance
# turns off its free whitespace, which a random model would pad with to the end).
TAGGED_CALL = ('start: /[a-z]{1,6}/ " <tool_call>" call "</tool_call>"\n'
               'call: %json ' + json.dumps({
                   "x-guidance": {"whitespace_flexible": False},
                   "type": "object", "additionalProperties": False,
                   "required": ["name", "arguments"],
                   "properties": {"name": {"const": "get_weather"},
                                  "arguments": WEATHER["function"]["parameters"]}}))


def test_auto_tool_calls_are_parsed_from_tagged_text(client):
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          temperature=0.7, seed=9, max_tokens=96,
                                          extra_body={"guided_grammar": TAGGED_CALL})
    choice = chat.choices[0]
    _check_calls(choice, {"get_weather"})
    assert re.fullmatch(r"[a-z]{1,6} ", choice.message.content)
    # tool_choice none: the same text is the content, no calls
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                          tool_choice="none", temperature=0.7, seed=9,
                                          max_tokens=96,
                                          extra_body={"guided_grammar": TAGGED_CALL})
    assert chat.choices[0].message.tool_calls is None
    assert "<tool_call>" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """A reply with two tagged calls gives both; with parallel_tool_calls false, the same reply
    (same seed) gives only the first, streamed or not."""
    second = '" <tool_call>" call "</tool_call>"'
    two = TAGGED_CALL.replace('"</tool_call>"', '"</tool_call>" ' + second, 1)
    common = dict(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.7, seed=9,
                  max_tokens=160, extra_body={"guided_grammar": two})
    both = client.chat.completions.create(**common).choices[0].message.tool_calls
    assert len(both) == 2
    one = client.chat.completions.create(parallel_tool_calls=False, **common).choices[0]
    assert [(c.function.name, c.function.arguments) for c in one.message.tool_calls] == \
        [(both[0].function.name, both[0].function.arguments)]
    assert one.finish_reason == "tool_calls"
    _, calls, _ = _stream(client, parallel_tool_calls=False, **common)
    assert calls[0] == [(both[0].function.name, both[0].function.arguments)]


def test_tool_history_renders_and_bad_tool_choice_is_a_400(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    chat = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                          tool_choice="required", temperature=0, max_tokens=96)
    _check_calls(chat.choices[0], {"get_weather", "get_time"})
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=8, **bad)


def _stream(client, **kwargs):
    """(content per choice, tool calls per choice as (name, arguments), finish reasons)."""
    content: dict[int, str] = {}
    calls: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for call in c.delta.tool_calls or []:
                calls.setdefault(c.index, []).append((call.function.name, call.function.arguments))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return content, calls, finish


@pytest.mark.parametrize("kwargs", [
    dict(response_format=_schema_format(SCHEMAS["nested_object"])),
    dict(tools=TOOLS, tool_choice="required"),
    dict(tools=TOOLS, extra_body={"guided_grammar": TAGGED_CALL}),
], ids=["json_schema", "required_tool", "auto_tool"])
def test_streaming_equals_non_streaming(client, kwargs):
    common = dict(model="tiny", messages=MESSAGES, temperature=0.9, seed=21, n=2, max_tokens=96,
                  **kwargs)
    full = client.chat.completions.create(**common)
    content, calls, finish = _stream(client, **common)
    for choice in full.choices:
        i = choice.index
        assert content[i] == (choice.message.content or "")
        assert calls.get(i, []) == [(c.function.name, c.function.arguments)
                                    for c in choice.message.tool_calls or []]
        assert finish[i] == choice.finish_reason


def test_constrained_with_speculation_equals_constrained_alone(server, spec_server):
    spec_client = openai_client(spec_server)
    plain_client = openai_client(server)
    proposed = lambda: spec_server.in_engine(lambda e: e.spec_stats.num_proposed)  # noqa: E731
    for schema in (SCHEMAS["person"], SCHEMAS["array_of_objects"], SCHEMAS["refs"]):
        kwargs = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=96,
                      response_format=_schema_format(schema))
        want = plain_client.chat.completions.create(**kwargs).choices[0].message.content
        got = spec_client.chat.completions.create(**kwargs).choices[0].message.content
        assert got == want
        jsonschema.validate(json.loads(got), schema)
    # constrained requests decode one masked token per step: nothing was proposed for them,
    # while an unconstrained request on the same engine speculates
    assert proposed() == 0
    phrase = list(range(300, 309))
    spec_client.completions.create(model="tiny", prompt=phrase * 4, temperature=0, max_tokens=24)
    assert proposed() > 0
    spec_server.assert_clean()
    server.assert_clean()
