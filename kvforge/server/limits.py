"""How many tokens a request may generate: prompt + max_tokens must fit the model's context.

As OpenAI and vLLM do, an explicit ``max_tokens`` that does not fit is a 400 at once (the
request would otherwise run until the context is full, long after a client gave up); an absent
one is capped to what fits.
"""
from __future__ import annotations

from kvforge.server.errors import OpenAIError


def output_budget(max_model_len: int, prompt_lens: list[int], requested: int | None, *,
                  default: int | None, param: str, prompt_param: str) -> int:
    """``max_tokens`` for prompts of ``prompt_lens`` tokens sharing one set of sampling params.

    requested: the client's value (None: not given). default: the API's default when not given
    (None: as many as fit). param / prompt_param: the fields an error points at.
    """
    longest = max(prompt_lens)
    room = max_model_len - longest
    if room < 1:
        raise OpenAIError(
            400, f"This model's maximum context length is {max_model_len} tokens, but the prompt "
                 f"has {longest} tokens, which leaves no room for output. Please shorten the "
                 f"prompt.", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if longest + requested > max_model_len:
        raise OpenAIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                 f"requested {longest + requested} tokens ({longest} in the prompt, {requested} "
                 f"in the completion). Please reduce the length of the prompt or completion.",
            param=param, code="context_length_exceeded")
    return requested
