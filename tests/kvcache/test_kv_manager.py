import pytest

from kvforge.engine.request import Request
from kvforge.kvcache.kv_manager import AllocatedSlots, KVCacheManager
from kvforge.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id="r", num_tokens=6, num_computed=0):
    req = Request(request_id, list(range(num_tokens)), SamplingParams())
    req.num_computed_tokens = num_computed
    return req


def snapshot(kv):
    return ({rid: kv.get_block_ids(rid) for rid in kv.request_ids()},
            [kv.pool.ref_cnt(b) for b in range(kv.num_blocks)], kv.pool.free_block_ids())


def test_allocates_only_missing_blocks_as_tokens_grow():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    req = make_request(num_tokens=6)
    assert kv.allocate_slots(req, 6) == AllocatedSlots([0, 1], [])
    req.num_computed_tokens = 6
    # positions 6, 7 still fit in block 1
    assert kv.allocate_slots(req, 2) == AllocatedSlots([], [])
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1) == AllocatedSlots([2], [])
    assert kv.get_block_ids("r") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    kv.check_integrity()


def test_chunked_allocation_matches_whole_allocation():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    req = make_request(num_tokens=11)
    assert kv.allocate_slots(req, 5).new_block_ids == [0, 1]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 5).new_block_ids == [2]
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1).new_block_ids == []
    assert kv.get_block_ids("r") == [0, 1, 2]


def test_allocate_returning_none_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a, b = make_request("a", 8), make_request("b", 9)
    kv.allocate_slots(a, 8)
    before = snapshot(kv)
    assert kv.allocate_slots(b, 9) is None               # needs 3, only 2 free
    assert snapshot(kv) == before and not kv.has_blocks("b")
    kv.check_integrity()


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    parent = make_request("p", 6)
    kv.allocate_slots(parent, 6)                          # [0, 1], block 1 half full
    kv.fork("p", "c")
    assert kv.get_block_ids("c") == [0, 1]
    assert kv.pool.ref_cnt(0) == 2 and kv.pool.ref_cnt(1) == 2
    kv.check_integrity()

    child = make_request("c", 7, num_computed=6)          # its first sampled token at pos 6
    slots = kv.allocate_slots(child, 1)
    assert slots == AllocatedSlots([2], [(1, 2)])
    assert kv.get_block_ids("c") == [0, 2] and kv.get_block_ids("p") == [0, 1]
    assert [kv.pool.ref_cnt(b) for b in (0, 1, 2)] == [2, 1, 1]
    kv.check_integrity()

    # the parent's block 1 is now private: no copy for it
    parent.num_computed_tokens = 6
    parent.append_output_token(99)
    assert kv.allocate_slots(parent, 1) == AllocatedSlots([], [])


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    kv.allocate_slots(make_request("p", 8), 8)             # [0, 1], both full
    kv.fork("p", "c")
    child = make_request("c", 9, num_computed=8)
    assert kv.allocate_slots(child, 1) == AllocatedSlots([2], [])
    assert kv.get_block_ids("c") == [0, 1, 2]
    assert kv.pool.ref_cnt(1) == 2
    kv.check_integrity()


def test_copy_on_write_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    kv.allocate_slots(make_request("p", 6), 6)
    kv.fork("p", "c")
    before = snapshot(kv)
    assert kv.allocate_slots(make_request("c", 7, num_computed=6), 1) is None
    assert snapshot(kv) == before
    kv.check_integrity()


def test_free_returns_blocks_tail_first_and_is_idempotent():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK)
    kv.allocate_slots(make_request("a", 12), 12)          # [0, 1, 2]
    kv.free("a")
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 6 and kv.usage == 0.0
    kv.check_integrity()


def test_freeing_parent_keeps_shared_blocks_for_child():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK)
    kv.allocate_slots(make_request("p", 5), 5)
    kv.fork("p", "c")
    kv.free("p")
    assert kv.get_block_ids("c") == [0, 1] and kv.num_free_blocks == 4
    assert kv.pool.ref_cnt(0) == 1
    kv.free("c")
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_fork_errors_and_bad_input():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    with pytest.raises(ValueError, match="'ghost'"):
        kv.fork("ghost", "c")
    kv.allocate_slots(make_request("p", 3), 3)
    kv.allocate_slots(make_request("c", 3), 3)
    with pytest.raises(ValueError, match="'c'"):
        kv.fork("p", "c")
    with pytest.raises(ValueError, match="-1"):
        kv.allocate_slots(make_request("p", 3), -1)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_check_integrity_catches_ref_mismatch():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    kv.allocate_slots(make_request("p", 3), 3)
    kv.pool.incref([0])                                   # a reference no table accounts for
    with pytest.raises(AssertionError, match="block 0"):
        kv.check_integrity()
    kv.check_integrity(extra_refs={0: 1})                 # e.g. held by a prefix cache


def test_usage_is_zero_when_only_the_prefix_cache_holds_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    a = make_request("a", 10)
    kv.allocate_slots(a, 10)                              # 3 blocks, 2 of them full
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    assert kv.usage == pytest.approx(3 / 8)
    b = make_request("b", 9)                              # same first 8 tokens
    kv.allocate_slots(b, 9 - 8, kv.match_prefix(b))        # shares the 2 cached blocks
    assert kv.usage == pytest.approx(4 / 8)
    kv.free("a")
    assert kv.usage == pytest.approx(3 / 8)               # b's own block + the 2 it shares
    kv.free("b")
    stats = kv.prefix_cache_stats
    assert kv.usage == 0.0 and stats.cached_blocks == 2 and stats.evictable_blocks == 2
    assert kv.num_free_blocks == 8                        # the cached ones count as capacity
    kv.check_integrity()
