"""Preemption that keeps work: swap a preempted request's KV to a slower tier, or recompute.

``--preemption-mode``:
- ``recompute`` (default): drop the KV; on re-admission the prefix cache gives back whatever
  full blocks it still holds and the rest is recomputed.
- ``swap``: always snapshot the KV to the host pool (disk when the host pool is short).
- ``auto``: per preemption, swap when moving the bytes out and back is cheaper than recomputing
  the tokens the prefix cache would not give back:

      swap  iff  2 * blocks * block_bytes / bandwidth(tier)  <  uncached_tokens * flops_per_token / flops_per_s

Prefix-cache consistency: the snapshot covers all the request's computed blocks (copying bytes
out changes nothing for the radix tree, which keeps its own references). On re-admission the
blocks the tree still holds are matched as usual and only the blocks after the match are copied
back into freshly allocated private blocks; if the tree now holds at least as many tokens as
the snapshot, the snapshot is simply discarded. A swapped request waits with
``num_computed_tokens == 0`` like any preempted one; admission sets it to the snapshot's count.

Copies are synchronous at the scheduling decision (swap-out before the victim's blocks are
freed, swap-in right after the new blocks are allocated), which is before any forward can
overwrite them. On CPU there is nothing to overlap with; on a GPU they belong on a side stream.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvforge.engine.request import Request
from kvforge.kvcache.kv_manager import AllocatedSlots, KVCacheManager, cdiv
from kvforge.kvcache.radix_tree import MatchResult
from kvforge.kvcache.tiers import TieredKVStore

PREEMPTION_MODES = ("recompute", "swap", "auto")


@dataclass(slots=True)
class SwapCostModel:
    """Seconds to move bytes vs seconds to recompute tokens (defaults: a CPU box)."""

    flops_per_token: float                 # ~2 x parameters of the model
    flops_per_s: float = 5e10
    host_bytes_per_s: float = 5e9
    disk_bytes_per_s: float = 1e9

    def prefers_swap(self, num_bytes: int, uncached_tokens: int, tier: str) -> bool:
        bandwidth = self.host_bytes_per_s if tier == "host" else self.disk_bytes_per_s
        return 2 * num_bytes / bandwidth < uncached_tokens * self.flops_per_token / self.flops_per_s


class KVSwapper:
    """The scheduler's swap decisions and bookkeeping over a TieredKVStore."""

    def __init__(self, mode: str, store: TieredKVStore, kv_manager: KVCacheManager,
                 cost: SwapCostModel, force_disk: bool = False) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.store = store
        self.kv_manager = kv_manager
        self.cost = cost
        self.force_disk = force_disk
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.store.handles

    def on_preempt(self, request: Request) -> None:
        """Called before the victim's blocks are freed: snapshot them if swapping pays."""
        n = request.num_computed_tokens
        block_ids = self.kv_manager.get_block_ids(request.request_id)[:cdiv(n, self.kv_manager.block_size)]
        if self.mode == "recompute" or n == 0 or not block_ids:
            return
        if self.mode == "auto":
            cached = self.kv_manager.prefix_match_length(request)
            tier = ("host" if not self.force_disk
                    and self.store.host.num_free_blocks >= len(block_ids) else "disk")
            if not self.cost.prefers_swap(len(block_ids) * self.store.block_bytes,
                                          n - min(cached, n), tier):
                return
        handle = self.store.swap_out(request.request_id, block_ids, n, force_disk=self.force_disk)
        request.num_swaps += 1
        request.swapped_bytes += handle.num_bytes
        self.num_swap_outs += 1

    def admit(self, request: Request, prefix: MatchResult | None, tokens_left: int,
              num_to_schedule: Callable[[Request, int], int]) -> tuple[int, AllocatedSlots | None]:
        """Admit a swapped request: blocks for [0, snapshot + chunk), copy the snapshot's blocks
        after the prefix match back in. Returns (chunk tokens, slots) or (0, None) if the pool
        is short (the snapshot stays where it is)."""
        B = self.kv_manager.block_size
        handle = self.store.handles[request.request_id]
        matched = prefix.num_tokens if prefix else 0
        if matched >= handle.num_tokens:
            self.store.discard(request.request_id)      # the prefix cache has it all
            request.num_computed_tokens = matched
            num_tokens = num_to_schedule(request, tokens_left)
            return num_tokens, (self.kv_manager.allocate_slots(request, num_tokens, prefix)
                                if num_tokens > 0 else None)
        request.num_computed_tokens = handle.num_tokens
        num_tokens = num_to_schedule(request, tokens_left)
        request.num_computed_tokens = matched
        if num_tokens == 0:
            return 0, None
        slots = self.kv_manager.allocate_slots(request, handle.num_tokens - matched + num_tokens,
                                               prefix)
        if slots is None:
            return 0, None
        table = self.kv_manager.get_block_ids(request.request_id)
        first = matched // B                            # matches are whole blocks
        self.store.swap_in(request.request_id, table[first:handle.num_blocks], first_block=first)
        request.num_computed_tokens = handle.num_tokens
        self.num_swap_ins += 1
        return num_tokens, slots

    def discard(self, request: Request) -> None:
        self.store.discard(request.request_id)

    def check_integrity(self, waiting_ids: set[str]) -> None:
        self.store.check_integrity()
        stray = set(self.store.handles) - waiting_ids
        assert not stray, f"swapped KV of requests that are not waiting: {sorted(stray)}"


def validate_swap_args(mode: str, host_blocks: int | None) -> None:
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    if host_blocks is not None and (not isinstance(host_blocks, int) or isinstance(host_blocks, bool)
                                    or host_blocks < 0):
        raise ValueError(f"swap_host_blocks must be an integer >= 0, got {host_blocks!r}")


def build_kv_swapper(config, runner, kv_manager: KVCacheManager) -> KVSwapper | None:
    """The engine's swapper for ``config.preemption_mode`` (None for recompute)."""
    if config.preemption_mode == "recompute":
        return None
    host_blocks = kv_manager.num_blocks if config.swap_host_blocks is None else config.swap_host_blocks
    store = TieredKVStore(runner.kv_caches, kv_manager.block_size, host_blocks, config.swap_dir)
    num_params = sum(p.numel() for p in runner.model.parameters())
    return KVSwapper(config.preemption_mode, store, kv_manager,
                     SwapCostModel(flops_per_token=2.0 * num_params))
