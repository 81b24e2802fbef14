"""Tool calls: the schema a forced call must match, and the model's calls read from its text.

Two ways a call comes out of the model:

* tool_choice "auto": the chat template showed the tools and the model writes each call as
  (Hermes / Qwen2.5 style)  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  possibly with text around it. The tags are parsed; what is left is the message content.
  Small models (Qwen2.5-Coder-0.5B) often answer with the bare call object instead, or in a
  markdown ```json fence: a whole answer that is one such object naming one of the request's
  tools is read as that call.
* tool_choice "required" or a named function: the output is grammar-constrained to exactly one
  call object ``{"name": ..., "arguments": {...}}`` whose arguments match the function's
  parameter schema (as vLLM does); the whole text is that call.

Streaming (``ToolCallStream``): content is sent as it comes until a ``<tool_call>`` may begin;
from there the text is held back and the calls go out whole in one ``delta.tool_calls`` chunk
when the choice finishes (clients accumulate deltas, so one delta is a valid stream).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_TAGGED = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)


@dataclass
class ParsedToolCall:
    name: str
    arguments: dict

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI shape (``index`` for a streamed delta), with a fresh call id."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name,
                             "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return call if index is None else {"index": index, **call}


def function_call_schema(function) -> dict:
    """JSON schema of one call object of ``function`` (a FunctionDefinition)."""
    return {"type": "object",
            "properties": {"name": {"const": function.name},
                           "arguments": function.parameters or {"type": "object",
                                                                "properties": {}}},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_schema(tools, named: str | None) -> dict:
    """The schema a "required" (any one of the tools) or named call is constrained to."""
    functions = [t.function for t in tools if named is None or t.function.name == named]
    if len(functions) == 1:
        return function_call_schema(functions[0])
    return {"anyOf": [function_call_schema(f) for f in functions]}


def _call_from_json(text: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):      # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(obj["name"], arguments)


def parse_forced_call(text: str) -> list[ParsedToolCall]:
    """The constrained output: one call object, or nothing if it was cut short."""
    call = _call_from_json(text)
    return [call] if call is not None else []


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _bare_call(text: str, tool_names: set[str]) -> ParsedToolCall | None:
    """The whole answer as one call object (optionally in a ```json fence) naming a tool."""
    text = text.strip()
    fenced = _FENCE.match(text)
    call = _call_from_json(fenced.group(1) if fenced else text)
    return call if call is not None and call.name in tool_names else None


def parse_tagged_calls(text: str, tool_names: set[str] | None = None
                       ) -> tuple[str | None, list[ParsedToolCall]]:
    """(content outside the calls, None if only whitespace; the calls), from free text.
    Without tagged calls, a whole answer that is a call object of one of ``tool_names`` is one.

    A ``<tool_call>`` block that is not a valid call stays in the content, as written. The
    content is not otherwise trimmed, so a stream's content deltas add up to exactly it."""
    calls: list[ParsedToolCall] = []
    content_parts: list[str] = []
    pos = 0
    for m in _TAGGED.finditer(text):
        call = _call_from_json(m.group(1).strip())
        if call is None:
            continue
        content_parts.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    content_parts.append(text[pos:])
    if not calls and tool_names:
        bare = _bare_call(text, tool_names)
        if bare is not None:
            return None, [bare]
    content = "".join(content_parts)
    return (content if content.strip() else None), calls


def _possible_start(text: str) -> int:
    """Index from which ``text`` may be the beginning of a ``<tool_call>`` (len: none)."""
    i = text.find(TOOL_CALL_START)
    if i >= 0:
        return i
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolCallStream:
    """One streamed choice of a request with tools: what content to send now, and the calls at
    the end. ``forced``: the whole output is a call (no content ever). An answer that starts
    like a bare call object (``{`` or a ``` fence) is held back whole until it finishes."""

    def __init__(self, forced: bool, tool_names: set[str] | None = None) -> None:
        self.forced = forced
        self.tool_names = tool_names
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.forced:
            return ""
        safe = _possible_start(self.text)
        head = self.text.lstrip()
        if not self.text[:safe].strip():     # whitespace before a call is not content
            return ""
        if self.tool_names and self.sent == 0 and (head.startswith(("{", "```"))
                                                   or "```".startswith(head)):
            return ""                        # may be a bare call: wait for the whole answer
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(content still to send, the calls) once the choice has finished."""
        if self.forced:
            calls = parse_forced_call(self.text)
            return ("" if calls else self.text), calls
        content, calls = parse_tagged_calls(self.text, self.tool_names)
        # what went out is text before the first "<tool_call>", so a prefix of the content
        return (content or "")[self.sent:], calls
