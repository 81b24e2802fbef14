"""KVCacheManager with an attention window: out-of-window blocks released, exact ids."""
from __future__ import annotations

import sys

import pytest

from kvforge.attention.window import AttentionWindow
from kvforge.engine.request import Request
from kvforge.kvcache.kv_manager import NULL_BLOCK, AllocatedSlots, KVCacheManager
from kvforge.sampling_params import SamplingParams

BLOCK = 4
N = NULL_BLOCK


def make_request(request_id="r", num_tokens=200):
    return Request(request_id, list(range(num_tokens)), SamplingParams())


def step(kv, req, num_new):
    """Allocate num_new tokens from the request's computed position, then mark them computed."""
    slots = kv.allocate_slots(req, num_new)
    assert slots is not None
    req.num_computed_tokens += num_new
    kv.check_integrity()
    kv.check_window(req.request_id, req.num_computed_tokens)
    return slots


def test_releases_exactly_the_blocks_that_leave_the_window():
    # S = 2, W = 6: block 0 (sinks) is kept; block i >= 1 dies once next_pos - 6 + 1 >= 4(i + 1)
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, window=AttentionWindow(2, 6))
    req = make_request()
    assert step(kv, req, 12) == AllocatedSlots([0, 1, 2], [], [])       # prompt 0..11
    assert step(kv, req, 1) == AllocatedSlots([3], [], [])              # pos 12: window 7..12
    # next position 13: window 8..13, block 1 (4..7) dead
    assert step(kv, req, 1) == AllocatedSlots([], [], [1])
    assert kv.get_block_ids("r") == [0, N, 2, 3]
    assert kv.num_held_blocks("r") == 3 and kv.pool.free_block_ids()[-1] == 1
    for _ in range(3):                                                   # 14, 15, 16
        step(kv, req, 1)
    # next position 17: window 12..17, block 2 (8..11) dead; position 16 got block 4 (the
    # free queue hands out the least recently freed first: 1 went to its tail)
    assert step(kv, req, 1) == AllocatedSlots([], [], [2])
    assert kv.get_block_ids("r") == [0, N, N, 3, 4]
    kv.free("r")
    kv.check_integrity()
    assert kv.num_free_blocks == 10


def test_chunked_prefill_releases_behind_the_chunk_and_bounds_the_table():
    w = AttentionWindow(4, 8)
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, window=w)
    req = make_request(num_tokens=400)
    held = []
    while req.num_computed_tokens < 400:
        step(kv, req, min(6, 400 - req.num_computed_tokens))
        held.append(kv.num_held_blocks("r"))
    assert max(held) <= w.max_live_blocks(BLOCK, 6) <= 12
    table = kv.get_block_ids("r")
    assert len(table) == 100 and table[0] != N        # logical indexing kept, sinks never freed
    # released when allocating, so as of the last chunk's first position (396)
    dead = w.dead_blocks(396, BLOCK)
    assert dead.stop == 97 and all(b == N for b in table[1:97]) and N not in table[97:]


def test_fork_shares_live_blocks_only_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, window=AttentionWindow(0, 4, "true"))
    parent = make_request("p")
    step(kv, parent, 10)
    step(kv, parent, 1)                                  # from 10: window 7..10, block 0 dead
    step(kv, parent, 1)                                  # from 11: window 8..11, block 1 dead
    assert kv.get_block_ids("p") == [N, N, 2]
    kv.fork("p", "c")
    assert kv.pool.ref_cnt(2) == 2
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    kv.check_integrity()
    assert kv.num_free_blocks == 10


def test_allocation_failure_still_releases_dead_blocks_and_retries_fit():
    # one request uses the whole pool; its dead blocks are what the next allocation needs
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, window=AttentionWindow(0, 4, "true"))
    req = make_request()
    step(kv, req, 16)
    assert kv.num_free_blocks == 0
    assert step(kv, req, 1) == AllocatedSlots([0], [], [0, 1, 2])       # 13..16 live
    assert kv.get_block_ids("r") == [N, N, N, 3, 0]


@pytest.mark.parametrize("window", [AttentionWindow(4, 8), AttentionWindow(0, 5),
                                    AttentionWindow(9, 13, "true")], ids=str)
@pytest.mark.parametrize("num_blocks", [8, 12, 20])     # a decode needs at most 7
def test_chunk_cap_is_the_largest_chunk_whose_live_blocks_fit(window, num_blocks):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, window=window)
    cap = kv.max_chunk_tokens
    assert window.max_live_blocks(BLOCK, cap) <= num_blocks
    assert window.max_live_blocks(BLOCK, cap + 1) > num_blocks
    assert kv.max_tokens_per_request(chunked=True) == sys.maxsize
    assert kv.max_tokens_per_request(chunked=False) == num_blocks * BLOCK


def test_no_chunk_cap_without_a_window_or_when_not_even_a_decode_fits():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    assert kv.max_chunk_tokens == sys.maxsize and kv.max_tokens_per_request() == 32
    # 1 sink block + ceil((3 + 15 + 1) / 4) = 6 blocks for a decode: a pool of 5 gives no
    # guarantee, so the request is bounded by the pool as without a window
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK, window=AttentionWindow(4, 16))
    assert kv.max_chunk_tokens == sys.maxsize and kv.max_tokens_per_request() == 20


def test_window_with_prefix_caching_is_refused():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True,
                       window=AttentionWindow(0, 8))


def test_integrity_catches_a_released_block_still_in_the_window():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK, window=AttentionWindow(2, 6))
    req = make_request()
    step(kv, req, 12)
    kv._block_tables["r"][2] = N                          # positions 8..11: visible from 12
    kv.pool.free([2])
    kv.check_integrity()                                  # refs agree ...
    with pytest.raises(AssertionError, match="released but visible"):
        kv.check_window("r", 12)                          # ... but the window is broken
    kv._block_tables["r"][0] = N
    kv.pool.free([0])
    with pytest.raises(AssertionError, match="sink block"):
        kv.check_integrity()
