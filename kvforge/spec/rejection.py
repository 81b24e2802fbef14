"""Lossless acceptance of proposed tokens, for a whole batch of speculating requests.

A request with drafts d_1..d_k runs 1 + k target rows in the verification forward:

    row:      0          1         ...   k
    input:    last tok   d_1       ...   d_k
    predicts: pos T      pos T+1   ...   pos T+k       (T = tokens before this step)
    checks:   d_1        d_2       ...   (bonus)

Greedy: accept d_j while the target argmax of row j-1 equals it; at the first mismatch emit the
target's argmax instead; if all k agree, emit row k's argmax as a bonus. Output = the target's
own greedy tokens, k + 1 at most per step.

Sampling (Leviathan et al. / Chen et al.): with p_j the target's and q_j the draft's
distribution at row j (after temperature, top-k, top-p, min-p, the same for both), accept d_j
with probability min(1, p_j(d_j) / q_j(d_j)); on the first rejection sample from
normalise(max(0, p_j - q_j)) and stop; after k acceptances sample a bonus from p_k. Every emitted
token is then distributed exactly as the target's. The n-gram proposer's q_j is a point mass on
d_j: accept with p_j(d_j), else sample from p_j with d_j removed.

Random draws come from the request's seeded generator when it has one.
"""
from __future__ import annotations

import torch

from kvforge.engine.request import Request
from kvforge.kernels import ops as kernel_ops
from kvforge.layers.sampler import SamplingBatch, exponential_race, sampling_probs


def verify_proposals(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                     draft_probs: dict[str, torch.Tensor] | None = None) -> list[list[int]]:
    """``logits`` [sum(1 + k_i), V]: each request's 1 + k_i verification rows, in order.

    Returns per request the emitted tokens: accepted drafts then one target token (1..k_i + 1).
    ``draft_probs[request_id]`` [k_i, V] is the draft's q for sampling requests; missing = the
    drafts were fixed guesses (point mass).
    """
    draft_probs = draft_probs or {}
    counts = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not hold {sum(counts)} rows")
    logits = logits.float()
    row_requests = [r for r, c in zip(requests, counts) for _ in range(c)]
    batch = SamplingBatch.from_requests(row_requests, logits.shape[1], logits.device)
    target_argmax = kernel_ops.argmax_last_dim(logits).tolist()
    probs = None if batch.all_greedy else sampling_probs(logits, batch)

    results: list[list[int]] = []
    row0 = 0
    for req, draft, count in zip(requests, drafts, counts):
        if batch.is_greedy[row0]:
            results.append(_accept_greedy(draft, target_argmax[row0:row0 + count]))
        else:
            results.append(_accept_sampled(probs[row0:row0 + count], draft,
                                           draft_probs.get(req.request_id), req.generator))
        row0 += count
    return results


def _accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    out = []
    for j, token in enumerate(draft):
        if target[j] != token:
            break
        out.append(token)
    out.append(target[len(out)])
    return out


def _accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """``p`` [k + 1, V] target probs, ``q`` [k, V] draft probs or None (point masses)."""
    k = len(draft)
    idx = torch.arange(k, device=p.device)
    d = torch.tensor(draft, dtype=torch.int64, device=p.device)
    p_d = p[idx, d]
    q_d = q[idx, d] if q is not None else torch.ones_like(p_d)
    # p_d / q_d > u  <=>  accept with probability min(1, p/q); q_d > 0 since d was drawn from q
    u = torch.rand(k, generator=generator, device="cpu" if generator is not None else p.device)
    accepted = (p_d.cpu() > u.cpu() * q_d.cpu()).tolist()
    out = []
    for j in range(k):
        if not accepted[j]:
            if q is not None:
                residual = (p[j] - q[j]).clamp_(min=0)
            else:
                residual = p[j].clone()
                residual[draft[j]] = 0.0
            if float(residual.sum()) <= 0.0:       # p == q up to rounding: nothing to correct
                residual = p[j]
            out.append(int(exponential_race(residual.unsqueeze(0), [generator])[0]))
            return out
        out.append(draft[j])
    out.append(int(exponential_race(p[k:k + 1], [generator])[0]))        # bonus token
    return out
