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

Copies go through a KVCopyEngine (kvforge/kvcache/copy_engine.py): inline (``sync``) or on a
worker thread / CUDA side stream (``async``), overlapped with the model's forward. Who may touch
which engine blocks while a copy is in flight:

    swap-out   victim's blocks ──copy──► tier        the swapper holds one pool reference on each
                                                     until the copy is done ("outgoing"): no
                                                     one can reuse them, the victim is waiting
    prefetch   tier ──copy──► blocks of a WAITING    allocated like an admission (prefix match +
    (swap-in)  request's own block table             private blocks), so they are referenced
                                                     by that table; the request is admitted
                                                     only after the copy is done ("prefetched")
    admission  tier ──copy──► new blocks, waited on before the step's forward

Blocks in flight are never free: outgoing ones are counted in ``held_block_refs`` (the KV
manager's integrity check adds them), prefetched ones sit in a block table. When the pool is
short the scheduler first calls ``make_room``: finish the outgoing copies (their blocks come
back) and cancel prefetches (the snapshot stays in its tier), and only then preempts.

Proactive swap-in (FastServe): at the end of every ``schedule()`` the swapped requests among the
head of the waiting queue (the next ``max_num_seqs`` in queue order) get their KV copied back,
while the pool's free blocks (never evicting cached ones) minus a reserve for the running
requests' next blocks allow; a request ahead of them that is not swapped counts its prompt
blocks against the same budget, so prefetching never takes the room of a request that runs first.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvforge.engine.request import Request
from kvforge.kvcache.copy_engine import COPY_MODES, CopyHandle, KVCopyEngine
from kvforge.kvcache.kv_manager import AllocatedSlots, KVCacheManager, cdiv
from kvforge.kvcache.radix_tree import MatchResult
from kvforge.kvcache.tiers import SwapHandle, TieredKVStore

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


@dataclass(slots=True)
class _InFlight:
    """Engine blocks one copy reads (swap-out) or writes (prefetch), and the copy."""

    block_ids: list[int]
    copy: CopyHandle


@dataclass
class SwapStats:
    """Counters since the engine started (``LLMEngine.swap_stats``)."""

    mode: str = "sync"                  # copy mode in use: sync | async
    num_swap_outs: int = 0
    num_swap_ins: int = 0               # admissions that got KV back from a tier
    num_prefetches: int = 0             # proactive swap-ins started
    num_prefetch_hits: int = 0          # admissions that found their KV already back
    num_prefetch_cancels: int = 0       # prefetches dropped to make room
    swapped_out_bytes: int = 0
    copy_seconds: float = 0.0           # inside copies
    exposed_seconds: float = 0.0        # the scheduling thread blocked on copies
    overlapped_seconds: float = 0.0     # copy time hidden behind the forward


class KVSwapper:
    """The scheduler's swap decisions and bookkeeping over a TieredKVStore."""

    def __init__(self, mode: str, store: TieredKVStore, kv_manager: KVCacheManager,
                 cost: SwapCostModel, force_disk: bool = False,
                 copier: KVCopyEngine | None = None, prefetch: bool = True) -> None:
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        self.mode = mode
        self.store = store
        self.kv_manager = kv_manager
        self.cost = cost
        self.force_disk = force_disk
        self.copier = copier or KVCopyEngine("sync")
        # proactive swap-in only pays when copies overlap the forward
        self.prefetch_enabled = prefetch and self.copier.is_async
        self._outgoing: dict[str, _InFlight] = {}      # swap-outs whose copy may still read
        self._prefetched: dict[str, _InFlight] = {}    # waiting requests with KV coming back
        self._stats = SwapStats(mode=self.copier.mode)

    @property
    def num_swap_outs(self) -> int:
        return self._stats.num_swap_outs

    @property
    def num_swap_ins(self) -> int:
        return self._stats.num_swap_ins

    @property
    def stats(self) -> SwapStats:
        c = self.copier.stats
        self._stats.copy_seconds = c.copy_seconds
        self._stats.exposed_seconds = c.exposed_seconds
        self._stats.overlapped_seconds = c.overlapped_seconds
        return self._stats

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.store.handles

    def is_prefetched(self, request_id: str) -> bool:
        return request_id in self._prefetched

    def prefetched_ids(self) -> set[str]:
        return set(self._prefetched)

    def held_block_refs(self) -> Counter:
        """Pool references the swapper holds: blocks outgoing copies still read."""
        return Counter(b for out in self._outgoing.values() for b in out.block_ids)

    # ---- swap-out ------------------------------------------------------------------------
    def on_preempt(self, request: Request) -> None:
        """Called before the victim's blocks are freed: snapshot them if swapping pays."""
        n = request.num_computed_tokens
        block_ids = self.kv_manager.get_block_ids(request.request_id)[:cdiv(n, self.kv_manager.block_size)]
        if self.mode == "recompute" or n == 0 or not block_ids:
            return
        if min(block_ids) < 0:
            return             # an attention window released some blocks: nothing to snapshot
        if self.mode == "auto":
            cached = self.kv_manager.prefix_match_length(request)
            tier = ("host" if not self.force_disk
                    and self.store.host.num_free_blocks >= len(block_ids) else "disk")
            if not self.cost.prefers_swap(len(block_ids) * self.store.block_bytes,
                                          n - min(cached, n), tier):
                return
        handle = self.store.reserve(request.request_id, len(block_ids), n,
                                    force_disk=self.force_disk)
        # the copy reads these blocks: one reference each until it is done, so that freeing the
        # victim's table cannot hand them to anyone
        self.kv_manager.pool.incref(block_ids)
        copy = self.copier.submit(lambda: self.store.copy_out(handle, block_ids))
        self._outgoing[request.request_id] = _InFlight(block_ids, copy)
        request.num_swaps += 1
        request.swapped_bytes += handle.num_bytes
        self._stats.num_swap_outs += 1
        self._stats.swapped_out_bytes += handle.num_bytes
        self.reap()

    def reap(self) -> None:
        """Give back the blocks of swap-outs whose copy is done (never waits)."""
        for request_id in [rid for rid, out in self._outgoing.items() if out.copy.done()]:
            self._finish_outgoing(request_id)

    def _finish_outgoing(self, request_id: str) -> None:
        out = self._outgoing.pop(request_id)
        try:
            self.copier.wait(out.copy)
        finally:
            self.kv_manager.pool.free(out.block_ids)

    # ---- swap-in -------------------------------------------------------------------------
    def admit(self, request: Request, prefix: MatchResult | None, tokens_left: int,
              num_to_schedule: Callable[[Request, int], int]) -> tuple[int, AllocatedSlots | None]:
        """Admit a swapped request: blocks for [0, snapshot + chunk), copy the snapshot's blocks
        after the prefix match back in (or find them already back: prefetch). Returns (chunk
        tokens, slots) or (0, None) if the pool is short (the snapshot stays where it is)."""
        rid = request.request_id
        if rid in self._outgoing:
            self._finish_outgoing(rid)        # re-admitted before its swap-out copy finished
        handle = self.store.handles[rid]
        if rid in self._prefetched:
            return self._admit_prefetched(request, handle, tokens_left, num_to_schedule)
        B = self.kv_manager.block_size
        matched = prefix.num_tokens if prefix else 0
        if matched >= handle.num_tokens:
            self.store.discard(rid)                     # the prefix cache has it all
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
        first = matched // B                            # matches are whole blocks
        dst = self.kv_manager.get_block_ids(rid)[first:handle.num_blocks]
        # this step's forward reads them: wait now (exposed unless the worker was idle-fast)
        self.copier.wait(self.copier.submit(lambda: self.store.copy_in(handle, dst, first)))
        self.store.release(rid)
        request.num_computed_tokens = handle.num_tokens
        self._stats.num_swap_ins += 1
        return num_tokens, slots

    def _admit_prefetched(self, request: Request, handle: SwapHandle, tokens_left: int,
                          num_to_schedule: Callable[[Request, int], int]
                          ) -> tuple[int, AllocatedSlots | None]:
        """Its table already holds [prefix | snapshot blocks]: once the copy is done it continues
        from the snapshot like a running request that grows."""
        rid = request.request_id
        self.copier.wait(self._prefetched[rid].copy)      # scheduled only with its KV back
        request.num_computed_tokens = handle.num_tokens
        num_tokens = num_to_schedule(request, tokens_left)
        slots = self.kv_manager.allocate_slots(request, num_tokens) if num_tokens > 0 else None
        if slots is None:
            request.num_computed_tokens = 0               # still waiting; blocks kept
            return 0, None
        del self._prefetched[rid]
        self.store.release(rid)
        self._stats.num_swap_ins += 1
        self._stats.num_prefetch_hits += 1
        return num_tokens, slots

    def prefetch(self, waiting_head: Sequence[Request], running: Sequence[Request]) -> None:
        """Proactive swap-in for the swapped requests among ``waiting_head`` (queue order), as
        far as the free blocks minus the running requests' reserve go."""
        if not self.prefetch_enabled:
            return
        B = self.kv_manager.block_size
        budget = self.kv_manager.pool.num_free_blocks - self.kv_manager.next_step_reserve(running)
        for request in waiting_head:
            rid = request.request_id
            if rid in self._prefetched:
                continue
            matched = self.kv_manager.prefix_match_length(request)
            handle = self.store.handles.get(rid)
            if handle is None:            # admitted before anything behind it: keep its room
                budget -= cdiv(request.num_tokens - matched, B)
                if budget < 0:
                    return
                continue
            if matched >= handle.num_tokens:
                continue                  # admission drops the snapshot: nothing to copy
            need = handle.num_blocks - matched // B
            if need > budget:
                return
            prefix = self.kv_manager.match_prefix(request)
            if self.kv_manager.allocate_slots(request, handle.num_tokens - matched, prefix) is None:
                return
            first = matched // B
            dst = self.kv_manager.get_block_ids(rid)[first:handle.num_blocks]
            copy = self.copier.submit(lambda h=handle, d=dst, f=first: self.store.copy_in(h, d, f))
            self._prefetched[rid] = _InFlight(dst, copy)
            self._stats.num_prefetches += 1
            budget -= need

    def _cancel_prefetch(self, request_id: str) -> None:
        """Its blocks go back to the pool (after the copy into them is done); the snapshot
        stays in its tier."""
        pre = self._prefetched.pop(request_id)
        try:
            self.copier.wait(pre.copy)
        finally:
            self.kv_manager.free(request_id)
        self._stats.num_prefetch_cancels += 1

    def make_room(self, keep: Request | None = None) -> bool:
        """The pool is short: finish every outgoing copy and cancel every prefetch (but
        ``keep``'s). Returns whether anything was given back, i.e. whether a retry can help."""
        released = bool(self._outgoing)
        for request_id in list(self._outgoing):
            self._finish_outgoing(request_id)
        for request_id in list(self._prefetched):
            if keep is None or request_id != keep.request_id:
                self._cancel_prefetch(request_id)
                released = True
        return released

    def discard(self, request: Request) -> None:
        """The request finished or was aborted while waiting: wait for its copies, drop its
        snapshot. A prefetched table is freed by the caller (after this returns)."""
        rid = request.request_id
        if rid in self._outgoing:
            self._finish_outgoing(rid)
        pre = self._prefetched.pop(rid, None)
        if pre is not None:
            self.copier.wait(pre.copy)
        self.store.discard(rid)

    def close(self) -> None:
        self.copier.close()

    def check_integrity(self, waiting_ids: set[str]) -> None:
        self.store.check_integrity()
        stray = set(self.store.handles) - waiting_ids
        assert not stray, f"swapped KV of requests that are not waiting: {sorted(stray)}"
        for rid, out in self._outgoing.items():
            assert rid in self.store.handles, f"outgoing copy of {rid!r} without a snapshot"
            for b in out.block_ids:
                assert self.kv_manager.pool.ref_cnt(b) >= 1, f"block {b} in flight but free"
        for rid, pre in self._prefetched.items():
            handle = self.store.handles.get(rid)
            assert handle is not None, f"prefetched {rid!r} lost its snapshot before admission"
            table = self.kv_manager.get_block_ids(rid)
            assert len(table) == handle.num_blocks, (
                f"prefetched {rid!r} holds {len(table)} blocks for a {handle.num_blocks}-block "
                f"snapshot")
            assert table[len(table) - len(pre.block_ids):] == pre.block_ids, (
                f"prefetched {rid!r}: table {table} does not end with its copy's {pre.block_ids}")


def validate_swap_args(mode: str, host_blocks: int | None, copy_mode: str = "auto") -> None:
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    if copy_mode not in COPY_MODES:
        raise ValueError(f"swap_copy_mode must be one of {COPY_MODES}, got {copy_mode!r}")
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
    copier = KVCopyEngine(config.swap_copy_mode, runner.kv_caches[0].device)
    return KVSwapper(config.preemption_mode, store, kv_manager,
                     SwapCostModel(flops_per_token=2.0 * num_params), copier=copier,
                     prefetch=config.swap_prefetch)
