"""Synthetic benchmark prompts of a fixed length (ShareGPT's: kvforge/bench/sharegpt.py)."""
from __future__ import annotations

from kvforge.bench.sharegpt import BenchRequest


def synthetic_requests(base_token_ids: list[int], num_requests: int, prompt_len: int,
                       output_len: int) -> list[BenchRequest]:
    """``num_requests`` prompts of exactly ``prompt_len`` tokens, each a different rotation of
    ``base_token_ids`` (repeated as needed), so no two requests share a first token as long as
    the base has at least ``num_requests`` distinct tokens."""
    if not base_token_ids:
        raise ValueError("base_token_ids must be non-empty")
    if num_requests < 1 or prompt_len < 1:
        raise ValueError(f"num_requests and prompt_len must be >= 1, got {num_requests}, {prompt_len}")
    n = len(base_token_ids)
    out = []
    for r in range(num_requests):
        ids = [base_token_ids[(r + k) % n] for k in range(prompt_len)]
        out.append(BenchRequest(ids, output_len))
    return out
