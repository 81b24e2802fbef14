"""Multi-step decoding: a batch of greedy decodes runs several steps in one compiled call.

Why: a batch-1 decode step of SmolLM2 streams ~540 MB of weights, which leaves nothing of the
engine's Python (scheduling, metadata, sampling, detokenizing) in the caches: that Python then
costs ~0.65 ms a step, ~5% of the step, run cold. With k steps per call it runs once per k
tokens (as vLLM's multi-step scheduling amortises its CPU work over GPU steps).

    engine.step()   plan_decode_steps: every running request a greedy decode, and k capped by
                    the scheduler's bound (Scheduler.decode_steps_allowed: nothing waits, or
                    every slot is taken and no admission or preemption falls inside the k steps)
                    -> request.num_lookahead_tokens = k - 1 on each (else 0)
    scheduler       1 + (k - 1) KV slots per decode; under KV pressure it drops the lookahead
                    before it preempts anyone
    runner          run_decode_steps: every row has the same k - 1 lookahead -> the model's
                    decode_steps(k) -> k tokens per row; otherwise one token per row and the
                    unused slots go back (Scheduler.update_from_output trims them)
    engine          stop checks token by token; a stop mid-way truncates the rest, as with
                    speculative decoding's accepted tokens
    interrupt       a request added (or aborted) while a call runs sets the runner's
                    ``decode_interrupt`` (LLMEngine.interrupt_decode_steps, any thread): the
                    call ends after the step in flight, so the newcomer is scheduled one step
                    later at most, not k; its rows come back with fewer than k tokens and the
                    unused slots go back as above

Lossless: each of the k steps is a one-step greedy sample of the same kernels (the compiled
stack's ``generate``), so outputs equal one step at a time; tests compare the two.

Eligible requests sample greedily with nothing that reads the logits besides argmax: no
penalties, no logprobs, ``min_tokens`` already reached (it masks stop tokens), no speculation.
k is capped so no request passes ``max_tokens`` or the longest sequence the engine allows.
"""
from __future__ import annotations

import torch

from kvforge.attention.metadata import padded_block_tables
from kvforge.engine.request import Request, RequestStatus
from kvforge.layers.sampler import GREEDY_TEMPERATURE
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import is_eligible


def decode_steps_for(request: Request, max_steps: int, max_len: int) -> int:
    """How many steps this request can take in one call (1: not eligible)."""
    p = request.sampling_params
    # is_eligible: no penalties, logprobs or unmet min_tokens (what speculation also needs)
    if (request.status is not RequestStatus.RUNNING or request.num_remaining_tokens != 1
            or request.spec_token_ids or request.pending_forks
            or p.temperature >= GREEDY_TEMPERATURE or not is_eligible(request)):
        return 1
    steps = min(max_steps, max_len - request.num_tokens)
    if p.max_tokens is not None:
        steps = min(steps, p.max_tokens - request.num_output_tokens)
    return max(1, steps)


def plan_decode_steps(running: list[Request], steps_allowed: int | None, max_steps: int,
                      max_len: int, model) -> int:
    """Set every running request's lookahead for the next step; returns the steps planned
    (1 = a plain step). One k for the whole batch: the compiled call steps every row together.
    ``steps_allowed`` (None = no bound) is the scheduler's: a request that could be admitted
    now, or that the policy would let preempt a running one within k steps, is scheduled at
    the step it would have been without multi-step decoding, not k steps later. Each row's k is
    also capped at its ``max_tokens``, so the call ends where the first of them finishes."""
    steps = 1
    if steps_allowed is not None:
        max_steps = min(max_steps, steps_allowed)
    if max_steps > 1 and running:
        steps = min(decode_steps_for(r, max_steps, max_len) for r in running)
        if steps > 1 and not model.can_decode_steps(len(running)):
            steps = 1
    for request in running:
        request.num_lookahead_tokens = steps - 1
    return steps


def run_decode_steps(model, sched: SchedulerOutput, kv_caches: list[torch.Tensor],
                     device: torch.device, stop: torch.Tensor | None = None
                     ) -> dict[str, list[int]] | None:
    """The step's tokens, request_id -> k tokens, when every scheduled request is a decode with
    the same k - 1 lookahead slots; None otherwise (the runner then runs one plain step).
    ``stop`` (int32 [1]): set by another thread, it ends the call after the step in flight
    (fewer than k tokens each)."""
    requests = sched.scheduled
    if not requests or sched.forked or sched.spec_token_ids:
        return None
    lookahead = sched.num_lookahead_tokens
    steps = 1 + lookahead.get(requests[0].request_id, 0)
    if steps == 1 or len(lookahead) != len(requests):
        return None
    for req in requests:
        if (lookahead[req.request_id] != steps - 1 or sched.num_query_tokens(req.request_id) != 1
                or req.num_computed_tokens != req.num_tokens - 1):
            return None
    block_tables = padded_block_tables([sched.block_ids[r.request_id] for r in requests])
    ids = torch.tensor([r.all_token_ids[-1] for r in requests], dtype=torch.int64)
    positions = torch.tensor([r.num_computed_tokens for r in requests], dtype=torch.int64)
    tokens = model.decode_steps(ids.to(device), positions.to(device), steps, kv_caches,
                                block_tables.to(device), stop).tolist()
    return {r.request_id: row for r, row in zip(requests, tokens)}
