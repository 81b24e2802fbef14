"""Response pieces in the OpenAI shapes: logprobs (completions and chat formats), usage."""
from __future__ import annotations

import difflib
from typing import Callable

TokenText = Callable[[int], str]


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # the engine gives {sampled: lp, top-1: lp, ...}; the k most likely are the top k by value
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int,
                        token_text: TokenText, text_offset: int) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for generated tokens."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.get(tid))
        top = {token_text(t): lp for t, lp in _top(entry, k)}
        top.setdefault(text, entry.get(tid))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echo_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                  token_text: TokenText) -> dict:
    """The echoed prompt's part of a completion's logprobs (``completion_logprobs``' shape,
    offsets from 0): its first token has no logprob (null), as OpenAI gives it."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry.get(tid))
        top = {token_text(t): lp for t, lp in _top(entry, k)}
        top.setdefault(text, entry.get(tid))
        out["top_logprobs"].append(top)
    return out


def join_logprobs(first: dict | None, then: dict | None) -> dict | None:
    """Two completion-logprobs blocks as one (the echoed prompt's, then the completion's)."""
    if first is None or then is None:
        return first if then is None else then
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int,
                  token_text: TokenText) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tid)
        content.append({
            "token": text, "logprob": entry.get(tid), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                              "bytes": list(token_text(t).encode("utf-8"))}
                             for t, lp in _top(entry, k)]})
    return {"content": content}


def usage(prompt_tokens: int, completions: list[list[int]], prediction: list[int]) -> dict:
    """Token counts of a response whose choices generated ``completions``; with a predicted
    output (Predicted Outputs), how many of its tokens each choice reproduced, in order
    (accepted), and how many it did not (rejected), summed over the choices. A prediction
    only steers speculation here, so rejected tokens are not billed as completion tokens."""
    completion_tokens = sum(len(c) for c in completions)
    accepted = sum(_common_in_order(prediction, c) for c in completions) if prediction else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": len(prediction) * len(completions) - accepted}}


def _common_in_order(a: list[int], b: list[int]) -> int:
    """Tokens of ``a`` found in ``b`` in the same order: the matching blocks of difflib's
    longest-match alignment (a common subsequence, near the longest one, in about linear
    time on texts that mostly agree, where an exact LCS would cost len(a) * len(b))."""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())
