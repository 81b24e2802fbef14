"""The proposer contract.

A proposer guesses up to k next tokens for a decoding request; the target model then checks all
of them in the same forward pass that computes the request's last token (kvforge/spec/rejection.py).
Two kinds, by when they can run:

* ``TokenProposer`` (n-gram): needs no model and no KV, so it proposes *before* scheduling and
  the scheduler reserves exactly the proposed tokens.
* ``DraftProposer`` (draft model, self-draft): writes KV as it drafts, so it runs *after*
  scheduling, once the lookahead slots exist and are exclusively writable (copy-on-write done).
  Before scheduling it only asks for k placeholder slots; it must then fill every slot.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvforge.engine.request import Request
from kvforge.sched.output import SchedulerOutput

# placeholder id for a lookahead slot a DraftProposer fills after scheduling
DRAFT_PLACEHOLDER = -1


class TokenProposer(ABC):
    """Proposes from the token ids alone, before scheduling."""

    @abstractmethod
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """At most ``max_tokens`` (>= 1) guesses for the tokens after ``token_ids``; [] if none."""

    def propose_matched(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """(guesses, n): the guesses and how many tokens of context they matched, which the
        decoder keeps acceptance by (0: the proposer has no such measure)."""
        return self.propose(token_ids, max_tokens), 0


class DraftProposer(ABC):
    """Drafts with a model after scheduling.

    ``propose`` replaces the placeholders of ``sched.spec_token_ids[rid]`` in place with drafted
    ids (all of them; the scheduler already counted them) and returns, for requests that sample
    (temperature > 0), the draft distributions ``q`` [k, V] the drafts were drawn from. Greedy
    requests get argmax drafts and no entry. It may write KV only into the slots
    ``sched.block_ids`` gives for positions < num_computed_tokens + num_scheduled_tokens.
    """

    @abstractmethod
    def propose(self, sched: SchedulerOutput, target_kv_caches: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        ...


def is_eligible(request: Request) -> bool:
    """Requests whose sampling can be verified position by position with one distribution.

    Penalties and min_tokens depend on the outputs before each position, logprobs would need a
    row per accepted token, a logit bias changes the distribution verification and the compiled
    multi-step argmax read: such requests decode one token per step (no speculation). So do
    constrained requests (structured output): each position's grammar mask depends on the tokens
    before it, so they sample one masked token per step (multi-step decoding uses this too).
    """
    p = request.sampling_params
    return (p.structured_output is None and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and p.logprobs is None and p.logit_bias is None
            and request.num_output_tokens >= p.min_tokens)
