"""Reading tool calls out of model text, whole and streamed."""
from __future__ import annotations

import json

from kvforge.server.tool_calls import (ToolCallStream, parse_forced_call, parse_tagged_calls)

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def test_tagged_calls_and_the_content_around_them():
    content, calls = parse_tagged_calls("Let me check. " + CALL + CALL.replace('"f"', '"g"'))
    assert content == "Let me check. "
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {"x": 1})]
    assert parse_tagged_calls("\n" + CALL + "\n") == (None, calls[:1])
    # a block that is not a call stays in the content as written; no block: plain content
    assert parse_tagged_calls("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])
    assert parse_tagged_calls("just text") == ("just text", [])
    # arguments written as JSON text are read as the object they encode
    _, calls = parse_tagged_calls('<tool_call>{"name": "f", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert calls[0].arguments == {"y": 2}


def test_forced_call_and_openai_shape():
    (call,) = parse_forced_call('{"name": "f", "arguments": {"x": [1, 2]}}')
    shaped = call.openai(index=0)
    assert shaped["index"] == 0 and shaped["type"] == "function"
    assert shaped["id"].startswith("call_") and len(shaped["id"]) == 29
    assert json.loads(shaped["function"]["arguments"]) == {"x": [1, 2]}
    assert parse_forced_call('{"name": "f", "argu') == []     # cut short by max_tokens


def test_stream_holds_back_a_possible_call_and_adds_up_to_the_whole():
    text = "Sure, " + CALL + " done"
    for cut in range(1, len(text)):
        stream = ToolCallStream(forced=False)
        sent = "".join(stream.feed(piece) for piece in (text[:cut], text[cut:]))
        assert "<" not in sent         # nothing of the call went out as content
        tail, calls = stream.finish()
        assert (sent + tail, [c.name for c in calls]) == ("Sure,  done", ["f"])
    stream = ToolCallStream(forced=False)
    assert stream.feed("a <tool") == "a "
    assert stream.feed("bar>") == "<toolbar>"
    assert stream.finish() == ("", [])
    forced = ToolCallStream(forced=True)
    assert forced.feed('{"name": "f", "arguments": {}}') == ""
    assert [c.name for c in forced.finish()[1]] == ["f"]


def test_a_bare_call_object_naming_a_tool_is_a_call():
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    for text in (fenced, ' {"name": "get_weather", "arguments": {"city": "Paris"}}'):
        content, calls = parse_tagged_calls(text, {"get_weather"})
        assert content is None and [(c.name, c.arguments) for c in calls] == [
            ("get_weather", {"city": "Paris"})]
        # not one of the request's tools, or no tools given: plain content
        assert parse_tagged_calls(text, {"other"}) == (text, [])
        assert parse_tagged_calls(text) == (text, [])
        stream = ToolCallStream(forced=False, tool_names={"get_weather"})
        assert "".join(stream.feed(c) for c in text) == ""
        assert stream.finish()[0] == "" and stream.finish()[1][0].name == "get_weather"
    stream = ToolCallStream(forced=False, tool_names={"get_weather"})
    sent = "".join(stream.feed(c) for c in '{"a": 1} is JSON')
    assert sent + stream.finish()[0] == '{"a": 1} is JSON'
