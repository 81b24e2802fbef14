"""Swap preemption decisions: the cost model, flag validation, and a swapped request coming
back with the prefix cache holding part of its KV (only the rest is copied back)."""
import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.request import Request
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
    assert EngineConfig(preemption_mode="auto", swap_host_blocks=0).swap_host_blocks == 0


def test_cost_model_weighs_bytes_against_recompute():
    cost = SwapCostModel(flops_per_token=2e9, flops_per_s=1e11, host_bytes_per_s=1e10,
                         disk_bytes_per_s=1e9)
    # recompute 100 tokens = 2 s; moving 1 GB out and back: host 0.2 s, disk 2 s
    assert cost.prefers_swap(10**9, 100, "host")
    assert not cost.prefers_swap(10**9, 100, "disk")
    assert not cost.prefers_swap(10**9, 0, "host")          # all cached: nothing to recompute


def make_setup(mode="swap", host_blocks=8):
    caches = [torch.randn(2, 8, B, 1, 2) for _ in range(2)]
    kv = KVCacheManager(8, B, enable_prefix_caching=True)
    store = TieredKVStore(caches, B, host_blocks)
    swapper = KVSwapper(mode, store, kv, SwapCostModel(flops_per_token=1.0))
    return caches, kv, store, swapper


def test_swap_in_reuses_cached_blocks_and_copies_back_the_rest():
    caches, kv, store, swapper = make_setup()
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
    for c in caches:                             # the freed tail block is reused by others
        c[:, table[2]] = 0.0

    prefix = kv.match_prefix(req)
    assert prefix.num_tokens == 8
    num_tokens, slots = swapper.admit(req, prefix, tokens_left=16,
                                      num_to_schedule=lambda r, left: min(r.num_remaining_tokens, left))
    assert num_tokens == 1 and slots is not None and req.num_computed_tokens == 10
    new_table = kv.get_block_ids("r")
    assert new_table[:2] == table[:2]            # the cached blocks, shared, not copied
    for c, before in zip(caches, tail_before):
        assert torch.equal(c[:, new_table[2]], before)
    assert not store.handles and swapper.num_swap_ins == 1
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
