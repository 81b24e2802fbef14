"""Swap preemption decisions: the cost model, flag validation, a swapped request coming back
with the prefix cache holding part of its KV (only the rest is copied back), and async copies:
blocks in flight are held and accounted, proactive swap-in, making room under pressure."""
import threading
from collections import Counter

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.request import Request
from kvforge.kvcache.copy_engine import KVCopyEngine
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.kvcache.tiers import TieredKVStore
from kvforge.sampling_params import SamplingParams
from kvforge.sched.swap import KVSwapper, SwapCostModel, validate_swap_args

B = 4


def test_flags_are_validated():
    with pytest.raises(ValueError, match="'later'"):
        validate_swap_args("later", None)
    with pytest.raises(ValueError, match="swap_host_blocks"):
        validate_swap_args("swap", -1)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="'sometimes'"):
        EngineConfig(preemption_mode="swap", swap_copy_mode="sometimes")
    with pytest.raises(ValueError, match="swap_prefetch"):
        EngineConfig(swap_prefetch="yes")
    assert EngineConfig(preemption_mode="auto", swap_host_blocks=0).swap_host_blocks == 0


def test_cost_model_weighs_bytes_against_recompute():
    cost = SwapCostModel(flops_per_token=2e9, flops_per_s=1e11, host_bytes_per_s=1e10,
                         disk_bytes_per_s=1e9)
    # recompute 100 tokens = 2 s; moving 1 GB out and back: host 0.2 s, disk 2 s
    assert cost.prefers_swap(10**9, 100, "host")
    assert not cost.prefers_swap(10**9, 100, "disk")
    assert not cost.prefers_swap(10**9, 0, "host")          # all cached: nothing to recompute


def make_setup(mode="swap", host_blocks=8, copy_mode="sync", prefix_caching=True, tmp=None):
    caches = [torch.randn(2, 8, B, 1, 2) for _ in range(2)]
    kv = KVCacheManager(8, B, enable_prefix_caching=prefix_caching)
    store = TieredKVStore(caches, B, host_blocks, cache_dir=tmp)
    swapper = KVSwapper(mode, store, kv, SwapCostModel(flops_per_token=1.0),
                        copier=KVCopyEngine(copy_mode))
    return caches, kv, store, swapper


class Gate:
    """Holds the async copy worker: copies submitted after it wait until ``open()``."""

    def __init__(self, copier: KVCopyEngine) -> None:
        self.event = threading.Event()
        copier.submit(self.event.wait)

    def open(self) -> None:
        self.event.set()


def next_chunk(request, tokens_left):
    return min(request.num_remaining_tokens, tokens_left)


def computed_request(kv, rid, num_tokens):
    """A request whose first ``num_tokens`` tokens have KV, about to decode token 11."""
    req = Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=5))
    kv.allocate_slots(req, num_tokens)
    req.num_computed_tokens = num_tokens
    req.append_output_token(99)
    return req


def preempt(swapper, kv, req):
    swapper.on_preempt(req)
    kv.free(req.request_id)
    req.num_computed_tokens = 0


@pytest.mark.parametrize("path", ["sync", "prefetch"])
def test_swap_in_reuses_cached_blocks_and_copies_back_the_rest(path):
    caches, kv, store, swapper = make_setup(copy_mode="sync" if path == "sync" else "async")
    req = Request("r", list(range(1, 11)), SamplingParams(max_tokens=5))
    kv.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    req.append_output_token(99)                  # 11 tokens, 10 with KV
    kv.cache_computed_blocks(req)                # the tree now holds blocks 0 and 1 (8 tokens)
    table = kv.get_block_ids("r")
    tail_before = [c[:, table[2]].clone() for c in caches]

    swapper.on_preempt(req)
    kv.free("r")
    req.num_computed_tokens = 0
    assert swapper.is_swapped(req) and req.num_swaps == 1
    assert req.swapped_bytes == 3 * store.block_bytes
    swapper.make_room()                          # async: the tail block is held until copied
    assert table[2] in kv.pool.free_block_ids()
    for c in caches:                             # the freed tail block is reused by others
        c[:, table[2]] = 0.0

    prefix = kv.match_prefix(req)
    assert prefix.num_tokens == 8
    if path == "prefetch":                       # the tail comes back before admission
        swapper.prefetch([req], running=[])
        assert swapper.is_prefetched("r") and len(kv.get_block_ids("r")) == 3
        assert req.num_computed_tokens == 0      # still an ordinary waiting request
    num_tokens, slots = swapper.admit(req, prefix, tokens_left=16, num_to_schedule=next_chunk)
    assert num_tokens == 1 and slots is not None and req.num_computed_tokens == 10
    new_table = kv.get_block_ids("r")
    assert new_table[:2] == table[:2]            # the cached blocks, shared, not copied
    for c, before in zip(caches, tail_before):
        assert torch.equal(c[:, new_table[2]], before)
    assert not store.handles and swapper.num_swap_ins == 1
    assert swapper.stats.num_prefetch_hits == (path == "prefetch")
    kv.check_integrity()
    store.check_integrity()
    kv.free("r")


def test_recompute_mode_and_fully_cached_snapshot_swap_nothing():
    _, kv, store, swapper = make_setup(mode="recompute")
    req = Request("r", list(range(1, 6)), SamplingParams(max_tokens=5))
    kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    swapper.on_preempt(req)
    assert not swapper.is_swapped(req) and req.num_swaps == 0
    kv.free("r")

    # auto: every computed block is cached in the tree -> recomputing is free -> no swap
    _, kv, store, swapper = make_setup(mode="auto")
    req = Request("s", list(range(1, 10)), SamplingParams(max_tokens=5))
    kv.allocate_slots(req, 9)
    req.num_computed_tokens = 8
    kv.cache_computed_blocks(req)
    swapper.on_preempt(req)
    assert not swapper.is_swapped(req)
    kv.free("s")
    store.check_integrity()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_async_swap_out_holds_the_victims_blocks_until_its_copy_is_done(tmp_path, tier):
    caches, kv, store, swapper = make_setup(copy_mode="async", prefix_caching=False,
                                            host_blocks=8 if tier == "host" else 0,
                                            tmp=str(tmp_path))
    req = computed_request(kv, "r", 10)
    table = kv.get_block_ids("r")
    before = [c[:, table].clone() for c in caches]
    gate = Gate(swapper.copier)
    preempt(swapper, kv, req)
    assert store.handles["r"].tier == tier
    # in flight: never free, referenced by the swapper and nobody else
    assert kv.num_free_blocks == 8 - 3
    assert swapper.held_block_refs() == Counter(table)
    kv.check_integrity(swapper.held_block_refs())
    with pytest.raises(AssertionError, match="ref_cnt"):
        kv.check_integrity()                     # the accounting is exact, not lenient
    swapper.check_integrity({"r"})
    other = Request("o", list(range(1, 33)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(other, 32) is None  # 8 blocks: the 3 in flight are not handed out
    swapper.reap()                               # not done yet: still held
    assert swapper.held_block_refs() == Counter(table)
    gate.open()
    assert swapper.make_room()                   # waits for the copy; the blocks come back
    assert kv.num_free_blocks == 8 and not swapper.held_block_refs()
    assert kv.allocate_slots(other, 32) is not None
    for c in caches:                             # another request overwrites every block
        c.fill_(7.0)
    kv.free("o")
    kv.check_integrity()
    num_tokens, slots = swapper.admit(req, None, tokens_left=16, num_to_schedule=next_chunk)
    assert num_tokens == 1 and req.num_computed_tokens == 10
    new_table = kv.get_block_ids("r")
    for c, b in zip(caches, before):
        assert torch.equal(c[:, new_table[:3]], b)
    assert not store.handles and not list(tmp_path.iterdir())
    kv.free("r")
    kv.check_integrity()
    swapper.close()


def test_prefetch_in_flight_is_accounted_and_admission_waits_for_it():
    caches, kv, store, swapper = make_setup(copy_mode="async", prefix_caching=False)
    req = computed_request(kv, "r", 10)
    before = [c[:, kv.get_block_ids("r")].clone() for c in caches]
    preempt(swapper, kv, req)
    swapper.make_room()
    for c in caches:
        c.fill_(0.0)
    gate = Gate(swapper.copier)
    swapper.prefetch([req], running=[])
    # a waiting request holding a block table, its copy queued behind the gate
    assert swapper.is_prefetched("r") and req.num_computed_tokens == 0
    assert kv.num_free_blocks == 5 and swapper.is_swapped(req)
    kv.check_integrity(swapper.held_block_refs())
    swapper.check_integrity({"r"})
    with pytest.raises(AssertionError, match="not waiting"):
        swapper.check_integrity(set())
    threading.Timer(0.05, gate.open).start()
    num_tokens, slots = swapper.admit(req, None, tokens_left=16, num_to_schedule=next_chunk)
    assert num_tokens == 1 and slots is not None and req.num_computed_tokens == 10
    for c, b in zip(caches, before):             # admitted only with its bytes back
        assert torch.equal(c[:, kv.get_block_ids("r")[:3]], b)
    stats = swapper.stats
    assert (stats.num_prefetches, stats.num_prefetch_hits, stats.num_swap_ins) == (1, 1, 1)
    kv.free("r")
    kv.check_integrity()
    assert not store.handles and store.host.num_free_blocks == 8
    swapper.close()


def test_prefetch_follows_queue_order_and_gives_way_under_pressure():
    caches, kv, store, swapper = make_setup(copy_mode="async", prefix_caching=False)
    req = computed_request(kv, "r", 10)          # 3 blocks
    preempt(swapper, kv, req)
    swapper.make_room()
    # a request ahead in the queue that needs 6 of the 8 free blocks: no prefetch behind it
    ahead = Request("ahead", list(range(1, 22)), SamplingParams(max_tokens=1))
    swapper.prefetch([ahead, req], running=[])
    assert not swapper.is_prefetched("r")
    # running requests keep room for their next chunk: a prefill with 16 tokens to go
    # reserves 5 blocks (7 free - 5 < 3), a decode its next block (7 - 1 >= 3)
    running = Request("run", list(range(1, 21)), SamplingParams(max_tokens=1))
    kv.allocate_slots(running, 4)
    running.num_computed_tokens = 4
    swapper.prefetch([req], running=[running])
    assert not swapper.is_prefetched("r")
    running.num_computed_tokens = 19             # now only its last prompt token is left
    swapper.prefetch([req], running=[running])
    assert swapper.is_prefetched("r") and kv.num_free_blocks == 4
    # pressure: the prefetch goes, the snapshot stays in its tier
    assert swapper.make_room()
    assert not swapper.is_prefetched("r") and swapper.is_swapped(req)
    assert kv.num_free_blocks == 7 and not kv.has_blocks("r")
    assert not swapper.make_room()               # nothing left to give back
    swapper.check_integrity({"r"})
    assert swapper.stats.num_prefetch_cancels == 1
    # prefetched again, then aborted while its copy is still queued: the copy finishes before
    # the scheduler frees the table, and the snapshot goes too
    gate = Gate(swapper.copier)
    swapper.prefetch([req], running=[running])
    assert swapper.is_prefetched("r")
    threading.Timer(0.05, gate.open).start()
    swapper.discard(req)
    assert gate.event.is_set() and not swapper.is_prefetched("r")
    kv.free("r")
    assert not store.handles and store.host.num_free_blocks == 8
    kv.free("run")
    kv.check_integrity()
    swapper.close()
