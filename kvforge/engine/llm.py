"""Offline API: ``LLM(model).generate(prompts, params)`` and ``LLM.chat(messages)``."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from kvforge.config import EngineConfig
from kvforge.engine.factory import create_engine
from kvforge.engine.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams

# a string, token ids, or vLLM's prompt dicts: {"prompt": str} / {"prompt_token_ids": [...]}
Prompt = str | list[int] | dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Batch generation with continuous batching under the hood.

    >>> llm = LLM()                     # default model: SmolLM2-135M-Instruct (GGUF)
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        # a masked-diffusion model gets the diffusion engine (engine/factory.py)
        self.engine = create_engine(EngineConfig.from_kwargs(model=model, **engine_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """``priority``: one int or one per prompt (lower first under the priority/mlfq
        policies; ignored by fcfs)."""
        prompt_list = _as_prompt_list(prompts)
        priorities = [priority] * len(prompt_list) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for "
                                 f"{len(prompt_list)} prompts")
        # validate everything before queueing anything, so a bad prompt leaves no half batch
        ids = []
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities):
                ids.append(self.engine.add_request(None, prompt, params, priority=prio))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while len(results) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]          # one prompt given as token ids
    return [_plain_prompt(p, i) for i, p in enumerate(prompts)]


def _plain_prompt(p: Any, index: int) -> str | list[int]:
    """A string or token-id list; vLLM's ``TextPrompt`` / ``TokensPrompt`` dicts unwrapped."""
    if isinstance(p, (str, list)):
        return p
    if not isinstance(p, dict):
        raise ValueError(f"prompt {index}: a prompt must be a string, a list of token ids or a "
                         f"dict with 'prompt' or 'prompt_token_ids', got {type(p).__name__}")
    if "multi_modal_data" in p:
        raise ValueError(f"prompt {index}: multi_modal_data is not supported: kvforge serves "
                         f"text-only models")
    unknown = sorted(set(p) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt {index}: unknown prompt keys {unknown}; expected 'prompt' "
                         f"or 'prompt_token_ids'")
    given = [k for k in _PROMPT_KEYS if k in p]
    if len(given) != 1:
        raise ValueError(f"prompt {index}: give exactly one of 'prompt' and 'prompt_token_ids', "
                         f"got {given or 'neither'}")
    value = p[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt {index}: 'prompt' must be a string, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and not (
            isinstance(value, (list, tuple)) and all(isinstance(t, int) for t in value)):
        raise ValueError(f"prompt {index}: 'prompt_token_ids' must be a list of ints")
    return value if isinstance(value, str) else list(value)
