"""Request bodies of the OpenAI API (pydantic); responses are built as plain dicts.

Unknown fields are ignored (clients send vendor extras); known fields of the wrong type or out of
range fail validation and become a 400 with the OpenAI error body (see errors.py).
"""
from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from kvforge.sampling_params import SamplingParams
from kvforge.structured.params import StructuredOutputParams

MAX_LOGPROBS = 20


def lone_surrogate_path(value) -> str | None:
    """Where in a decoded JSON value (``body.messages.0.content``) a string holds a lone UTF-16
    surrogate: JSON allows the escape ``"\\udcff"``, but such a string is not Unicode text and
    no tokenizer or UTF-8 encoder takes it. None when there is none. Iterative: nesting depth
    is the client's to choose."""
    stack = [("body", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((f"{path}.{key}", child))
                stack.append((path, key))    # a key is text too; checked first, so a bad key
                #                              never ends up in a path
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}", child) for i, child in enumerate(item))
    return None


class _RequestBody(BaseModel):
    """A request body: unknown fields ignored, no text that is not Unicode anywhere in it."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unicode_text_only(cls, data):
        path = lone_surrogate_path(data)
        if path is not None:
            raise ValueError(f"{path} is not valid Unicode text: it holds a lone surrogate "
                             f"(a \\uD800-\\uDFFF escape without its pair)")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": text or text parts}``."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["content"]
    content: str | list["PredictionPart"]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(part.text for part in c)


class PredictionPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _SamplingFields(_RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)     # what torch.Generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # token id (a JSON object's keys are strings of ids) -> bias in [-100, 100]; ids are checked
    # against the vocabulary by the handler (OpenAIServing.check_token_ids)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    prediction: Prediction | None = None      # a hint for n-gram speculation, output unchanged
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0             # scheduling_policy priority/mlfq: lower value goes first
    # structured outputs (kvforge/structured): OpenAI's response_format, or one of vLLM's extras
    # (accepted, but left out of the OpenAPI schema as vendor extras are)
    response_format: ResponseFormat | None = None
    guided_json: SkipJsonSchema[dict | str | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[list[str] | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None
    # masked-diffusion models (kvforge/diffusion): SamplingParams' fields of the same names
    diffusion_steps: SkipJsonSchema[int | None] = None
    diffusion_block_length: SkipJsonSchema[int] = 32
    remasking: SkipJsonSchema[str] = "low_confidence"
    parallel_threshold: SkipJsonSchema[float | None] = None
    diffusion_cache: SkipJsonSchema[str] = "none"

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(items)}")
        return v

    def structured_output(self) -> tuple[StructuredOutputParams | None, str | None]:
        """(what the output must match, the request field that asked for it); ValueError when
        several fields ask or one is malformed."""
        asked = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked["response_format"] = StructuredOutputParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs "
                                 "json_schema.schema (a JSON schema object)")
            asked["response_format"] = StructuredOutputParams(json=fmt.json_schema.json_schema)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                asked[name] = StructuredOutputParams(**{kind: value})
        if len(asked) > 1:
            raise ValueError(f"give at most one of response_format, guided_json, guided_regex, "
                             f"guided_choice, guided_grammar; got {sorted(asked)}")
        return next(iter(asked.values()), None), next(iter(asked), None)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_output: StructuredOutputParams | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            prediction=None if self.prediction is None else self.prediction.text(),
            structured_output=structured_output, diffusion_steps=self.diffusion_steps,
            diffusion_block_length=self.diffusion_block_length, remasking=self.remasking,
            parallel_threshold=self.parallel_threshold, diffusion_cache=self.diffusion_cache)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    # 0: no completion, the prompt scored (with echo and logprobs: lm-evaluation-harness's
    # loglikelihood requests)
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # OpenAI fields this server does not implement: refused when they would change the result
    # rather than ignored (a client would get something other than what it asked for)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of = {self.best_of} (more candidates than the n = {self.n} "
                             f"returned) is not supported; leave it unset or equal to n")
        if self.suffix:
            raise ValueError("suffix (text after the completion: fill-in-the-middle) is not "
                             "supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str            # JSON text, as the API returns it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


def _message_schema(schema: dict) -> None:
    """The OpenAPI schema states what the validators below check: a message has content and no
    tool_calls, or it is an assistant message with tool_calls (content optional)."""
    schema["anyOf"] = [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}},
         "not": {"required": ["tool_calls"]}},
        {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"}}}]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_message_schema)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None
    # required, except on an assistant message that only calls tools (validated after role
    # and tool_calls, which come first for that reason: errors then name messages.N.content)
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None       # role "tool": the call this message answers

    @field_validator("tool_calls")
    @classmethod
    def _only_assistants_call(cls, v, info):
        if v and info.data.get("role") != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not "
                             f"{info.data.get('role')}")
        return v

    @field_validator("content")
    @classmethod
    def _content_unless_tool_calls(cls, v, info):
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError(f"a {info.data.get('role', 'chat')} message needs content")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict:
        """The message as chat templates read it ("developer" is OpenAI's newer "system")."""
        out: dict = {"role": "system" if self.role == "developer" else self.role,
                     "content": self.text()}
        if self.tool_calls:
            # templates (Qwen2.5's among them) write the arguments with tojson: give the object
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None        # a JSON schema; None: no arguments
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True          # false: at most one call (the first) per choice

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {choice if isinstance(choice, str) else 'function'!r}"
                             f" needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names function {choice.function.name!r}, which "
                                 f"is not among the tools {names}")
        return self

    @property
    def tool_mode(self) -> str:
        """"none" (no tools, or tool_choice none), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict]:
        return [m.template_dict() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's shape), unless tool_choice is none."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int]
