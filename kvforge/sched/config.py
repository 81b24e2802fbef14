"""Scheduler limits, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.sched.mlfq import MLFQConfig


@dataclass(slots=True)
class SchedulerConfig:
    """How much work one step may hold.

    - ``max_num_batched_tokens``: token budget of one step (decode tokens + prefill chunks).
    - ``max_num_seqs``: most requests running at once (n > 1 siblings count from admission).
    - ``enable_chunked_prefill``: a prompt may be split over steps. When off a prompt is only
      scheduled whole, so this config REQUIRES ``max_num_batched_tokens >= max_model_len``
      (raises ValueError otherwise); without it a long prompt could never be scheduled.
    - ``max_model_len``: most tokens (prompt + output) one request may hold.
    - ``policy``: waiting-queue policy name (see ``kvforge.sched.queues``).
    - ``block_size``: tokens per KV block; must match the KVCacheManager's.
    - ``mlfq``: the ``MLFQConfig`` of policy ``mlfq`` (None = its defaults; see sched/mlfq.py).
    - ``prefill_ahead``: with every sequence slot taken, up to this many waiting requests get
      their whole prompt prefilled in a step's spare token budget, sample their first token and
      wait for a slot holding their KV ("parked"; 0 = off). Scheduler docstring says why.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048
    policy: str = "fcfs"
    block_size: int = 16
    mlfq: MLFQConfig | None = None
    prefill_ahead: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (not isinstance(self.prefill_ahead, int) or isinstance(self.prefill_ahead, bool)
                or self.prefill_ahead < 0):
            raise ValueError(f"prefill_ahead must be an integer >= 0, got {self.prefill_ahead!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so every prompt fits in one step")
        from kvforge.sched.mlfq import MLFQConfig
        if self.mlfq is not None and not isinstance(self.mlfq, MLFQConfig):
            raise ValueError(f"mlfq must be an MLFQConfig, got {self.mlfq!r}")
        from kvforge.sched.queues import available_policies
        if self.policy not in available_policies():
            raise ValueError(f"unknown scheduling policy {self.policy!r}; "
                             f"known: {available_policies()}")
