"""What the engine hands back to callers, per request (streamed or final)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None      # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None   # per generated token: {token_id: logprob}

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_swaps: int = 0                    # preemptions that swapped KV out instead of dropping it
    swapped_bytes: int = 0                # KV bytes swapped out (each swap-out counted)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    # streaming: the text added since the previous RequestOutput of this request, per output
    deltas: list[str] = field(default_factory=list)
