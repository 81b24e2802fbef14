"""A request as the scheduler and engine see it: token accounting in one vocabulary.

    all_token_ids = prompt_token_ids + output_token_ids
    |<-------------------- num_tokens -------------------->|
    |<-- num_computed_tokens (KV in cache) -->|<- to do ->|

A step schedules ``num_scheduled_tokens`` of the "to do" part. When computed tokens catch up
with ``num_tokens`` the step's logits at the last position yield the next token.
"""
from __future__ import annotations

import enum
import time

import torch

from kvforge.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"          # back in the waiting queue, its KV dropped
    FINISHED_STOPPED = "stop"        # EOS, stop token id or stop string
    FINISHED_LENGTH = "length"       # max_tokens or model context reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class Request:
    """One sequence. ``n > 1`` becomes n Requests; sample i of parent P has id ``P-i`` (i > 0)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 *, arrival_time: float | None = None, priority: int = 0,
                 eos_token_ids: tuple[int, ...] = (), parent_id: str | None = None,
                 sample_index: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.eos_token_ids = tuple(eos_token_ids)
        self.parent_id = parent_id
        self.sample_index = sample_index

        self.output_token_ids: list[int] = []
        # prompt + output kept as one list so slicing the next chunk is O(chunk)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # Predicted Outputs (SamplingParams.prediction), tokenized by the engine: n-gram lookup
        # searches them too (lookup_token_ids)
        self.prediction_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        # n > 1: ids of the sibling requests that fork from this one once its prompt is computed
        self.pending_forks: list[Request] = []
        # speculative decoding: tokens proposed for after the last one (kvforge/spec); the
        # scheduler verifies them with the last token, or drops them
        self.spec_token_ids: list[int] = []
        # multi-step decoding: extra tokens the engine wants this decode to generate in its
        # next step (engine/decode_steps.py sets it before each schedule; 0 = one token)
        self.num_lookahead_tokens = 0

        self.num_preemptions = 0
        self.num_swaps = 0                  # preemptions whose KV went to a slower tier
        self.swapped_bytes = 0              # bytes swapped out (sched/swap.py)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

        # sampling state
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed + sample_index)
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = []
        self.stop_reason: int | str | None = None
        # structured output: this sequence's GrammarMatcher (kvforge/structured), set by the
        # engine; it lives as long as the request, across preemptions
        self.grammar_matcher = None

    # derived counts: never stored twice
    @property
    def lookup_token_ids(self) -> list[int]:
        """What n-gram lookup searches: prompt + output, with the predicted output between
        them when the request has one. The suffix to match is still the output's end, and a
        match in the prediction is later than any in the prompt, so the latest occurrence (what
        the proposer takes) is the prediction's continuation where both match:

            [ prompt ........ ][ prediction ........ ][ output .. ]
                                     ^ match  -> guess     ^ suffix
        """
        if not self.prediction_token_ids:
            return self.all_token_ids
        return self.prompt_token_ids + self.prediction_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop outputs past the first ``num_output_tokens`` (a stop hit inside a run of
        speculatively accepted tokens); computed tokens never exceed the tokens kept."""
        if not 0 <= num_output_tokens <= self.num_output_tokens:
            raise ValueError(f"cannot truncate {self.num_output_tokens} outputs to "
                             f"{num_output_tokens!r}")
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
