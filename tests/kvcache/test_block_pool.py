import pytest

from kvforge.kvcache.block_pool import BlockPool


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(10)
    assert pool.num_free_blocks == 10 and pool.usage == 0.0
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert [pool.ref_cnt(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 5 and pool.usage == pytest.approx(0.5)
    pool.check_integrity()


def test_allocate_too_many_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.free_block_ids()
    assert pool.allocate(2) is None
    assert pool.free_block_ids() == before == [3]
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_freed_blocks_join_tail_in_given_order():
    pool = BlockPool(6)
    ids = pool.allocate(6)
    pool.free([4, 1, 5])
    assert pool.free_block_ids() == [4, 1, 5]
    pool.free([0])
    assert pool.free_block_ids() == [4, 1, 5, 0]
    # LRU: least recently freed is reused first
    assert pool.allocate(2) == [4, 1]
    pool.check_integrity()
    assert ids == list(range(6))


def test_shared_block_is_freed_only_at_last_reference():
    pool = BlockPool(4)
    pool.allocate(2)
    pool.incref([1])
    assert pool.ref_cnt(1) == 2
    pool.free([1])
    assert pool.ref_cnt(1) == 1 and 1 not in pool.free_block_ids()
    pool.free([1])
    assert pool.free_block_ids() == [2, 3, 1]
    pool.check_integrity()


def test_incref_revives_free_block_from_middle_of_queue():
    pool = BlockPool(5)
    pool.allocate(5)
    pool.free([0, 1, 2, 3, 4])
    pool.incref([2])
    assert pool.free_block_ids() == [0, 1, 3, 4]
    assert pool.ref_cnt(2) == 1
    pool.check_integrity()
    assert pool.allocate(4) == [0, 1, 3, 4]
    assert pool.allocate(1) is None


def test_double_free_and_bad_ids_raise():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.free([0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([3])
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_on_block_reused_hook_sees_every_handed_out_block():
    pool = BlockPool(3)
    reused = []
    pool.on_block_reused = reused.append
    pool.allocate(2)
    pool.free([1])
    pool.allocate(2)
    assert reused == [0, 1, 2, 1]


def test_check_integrity_catches_broken_back_link():
    pool = BlockPool(4)
    pool.blocks[2].prev_free = pool.blocks[0]          # should be block 1
    with pytest.raises(AssertionError, match="prev_free"):
        pool.check_integrity()


def test_check_integrity_catches_referenced_block_in_queue():
    pool = BlockPool(4)
    pool.blocks[1].ref_cnt = 1                          # referenced but still linked as free
    with pytest.raises(AssertionError, match="ref_cnt 1"):
        pool.check_integrity()


def test_check_integrity_catches_lost_free_block():
    pool = BlockPool(4)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0                          # count dropped without queueing it
    with pytest.raises(AssertionError, match="not in the free queue"):
        pool.check_integrity()


def test_check_integrity_catches_count_mismatch_and_negative():
    pool = BlockPool(4)
    pool.free_queue.num_free_blocks = 3
    with pytest.raises(AssertionError, match="counts 3"):
        pool.check_integrity()
    pool = BlockPool(2)
    pool.allocate(2)
    pool.blocks[0].ref_cnt = -1
    with pytest.raises(AssertionError, match="negative"):
        pool.check_integrity()


def test_check_integrity_catches_cycle():
    pool = BlockPool(3)
    pool.blocks[2].next_free = pool.blocks[0]           # forward walk would loop forever
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_usage_counts_request_references_not_the_prefix_caches():
    pool = BlockPool(4)
    pool.allocate(3)                                    # a request's blocks 0 1 2
    pool.incref([0, 1], by_cache=True)                  # 0 and 1 also cached
    assert pool.usage == pytest.approx(0.75) and pool.num_cached_blocks == 2
    pool.incref([1])                                    # a second request shares block 1
    pool.free([0, 1, 2])                                # the first request ends
    # 0: cache only (not used, not free); 1: cache + request; 2: free
    assert pool.num_used_blocks == 1 and pool.usage == pytest.approx(0.25)
    assert pool.free_block_ids() == [3, 2]
    pool.free([1])
    assert pool.usage == 0.0 and pool.num_free_blocks == 2      # idle, cache still warm
    pool.incref([0])                                    # a cache hit revives a request ref
    assert pool.num_used_blocks == 1
    pool.free([0])
    pool.free([0, 1], by_cache=True)                    # evicted
    assert pool.usage == 0.0 and pool.num_free_blocks == 4 and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_cache_and_request_references_cannot_stand_in_for_each_other():
    pool = BlockPool(3)
    pool.allocate(1)
    pool.incref([0], by_cache=True)
    with pytest.raises(RuntimeError, match="already cached"):
        pool.incref([0], by_cache=True)
    pool.free([0])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([0])                                  # only the cache's reference is left
    pool.free([0], by_cache=True)
    with pytest.raises(RuntimeError, match="does not hold"):
        pool.free([0], by_cache=True)
    pool.check_integrity()


def test_check_integrity_catches_wrong_used_count():
    pool = BlockPool(3)
    pool.allocate(2)
    pool.num_used_blocks = 1
    with pytest.raises(AssertionError, match="num_used_blocks"):
        pool.check_integrity()
