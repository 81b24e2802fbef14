"""What one scheduling step decided: the contract between Scheduler and ModelRunner."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.engine.request import Request


@dataclass
class SchedulerOutput:
    """One step.

    ``scheduled`` lists requests in batch order; each computes tokens
    ``all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens[id]]``
    (``num_computed_tokens`` is advanced only after the step, by ``update_from_output``).
    ``block_ids[id]`` is the request's whole block table after allocation for this step.
    ``block_copies`` are (src, dst) KV block copies the runner performs before the forward
    (copy-on-write of a shared partial block).
    ``forked[child_id] = parent_id``: the child shares the parent's prompt blocks and samples its
    first token from the parent's logits row of this step (n > 1); ``forked_requests`` holds
    those child Request objects in the same order.
    """

    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    forked: dict[str, str] = field(default_factory=dict)
    forked_requests: list[Request] = field(default_factory=list)   # the children named in forked
    preempted_request_ids: list[str] = field(default_factory=list)
    # speculative decoding: request_id -> proposed tokens scheduled after its last token (they
    # are the last len(...) of its num_scheduled_tokens; only accepted ones become computed)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # multi-step decoding: request_id -> KV slots scheduled after its last token for the tokens
    # the step goes on to generate (the last ones of num_scheduled_tokens; only the tokens it
    # returns become computed)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def num_query_tokens(self, request_id: str) -> int:
        """Tokens of the request this step feeds in (its scheduled tokens less the lookahead)."""
        return self.num_scheduled_tokens[request_id] - self.num_lookahead_tokens.get(request_id, 0)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
