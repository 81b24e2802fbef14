"""Request bodies of the OpenAI API (pydantic); responses are built as plain dicts.

Unknown fields are ignored (clients send vendor extras); known fields of the wrong type or out of
range fail validation and become a 400 with the OpenAI error body (see errors.py).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvforge.sampling_params import SamplingParams

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
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0             # scheduling_policy priority/mlfq: lower value goes first

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(items)}")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    # required for every role: without tool calls (not supported) a message is its content
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int]
