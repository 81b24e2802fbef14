"""Proposals and their confidences for the masked positions of a block.

x0: the token each position would become. Temperature 0 takes the argmax; otherwise LLaDA's
Gumbel trick, in float64 as LLaDA does: argmax(exp(logits) / (-log u)^T), u ~ U(0, 1), which is
a sample from softmax(logits / T).

Confidence orders the positions (the highest are committed; the rest stay masked, "remasked"):
  low_confidence  p(x0) under softmax(logits)                          (LLaDA)
  random          u ~ U(0, 1)                                          (LLaDA)
  entropy         sum p log p, the negative entropy                    (Dream)
  margin          p(top-1) - p(top-2)                                  (Dream)
"""
from __future__ import annotations

import torch


def _uniform(shape, dtype, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row, each from its request's generator (None: torch's global one)."""
    return torch.stack([torch.rand(shape[1:], dtype=dtype, generator=g) for g in generators])


def propose(logits: torch.Tensor, temperature: float, remasking: str,
            generators: list[torch.Generator | None],
            mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, V] logits -> (x0 [B, S], confidence [B, S]). The mask token is never proposed
    (a committed mask would leave the position masked for ever)."""
    logits = logits.clone()
    logits[..., mask_id] = float("-inf")
    if temperature > 0:
        noise = _uniform(logits.shape, torch.float64, generators)
        x0 = torch.argmax(logits.double().exp() / (-torch.log(noise)) ** temperature, dim=-1)
    else:
        x0 = torch.argmax(logits, dim=-1)
    if remasking == "random":
        return x0, _uniform(x0.shape, torch.float32, generators)
    p = torch.softmax(logits, dim=-1)
    if remasking == "low_confidence":
        return x0, torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
    if remasking == "entropy":
        return x0, (p * torch.log(p.clamp_min(1e-30))).sum(-1)
    if remasking == "margin":
        top2 = torch.topk(p, 2, dim=-1).values
        return x0, top2[..., 0] - top2[..., 1]
    raise ValueError(f"unknown remasking {remasking!r}")


def select_commits(confidence: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor | None,
                   threshold: float | None) -> torch.Tensor:
    """Which masked positions to commit this step, [B, S] bool.

    Fixed schedule: the ``counts[b]`` most confident masked positions of row b. Threshold
    (Fast-dLLM): every masked position with confidence > τ, and the most confident one always,
    so each step makes progress (τ = 1.0 is exactly one token per step)."""
    confidence = torch.where(masked, confidence, torch.tensor(float("-inf")))
    commit = torch.zeros_like(masked)
    if threshold is None:
        for row in range(confidence.shape[0]):
            k = int(counts[row])
            if k:
                commit[row, torch.topk(confidence[row], k).indices] = True
        return commit
    best = confidence.argmax(dim=-1, keepdim=True)
    commit.scatter_(1, best, masked.gather(1, best))
    return commit | (masked & (confidence > threshold))
