import pytest

from kvforge.engine.request import Request, RequestStatus
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.scheduler import Scheduler

BLOCK = 4
RUNNING, PREEMPTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED


def make_scheduler(num_blocks=10, budget=64, max_num_seqs=16, max_model_len=32, chunked=True,
                   policy="fcfs", prefill_ahead=0):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             enable_chunked_prefill=chunked, max_model_len=max_model_len,
                             policy=policy, block_size=BLOCK, prefill_ahead=prefill_ahead)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK))


def make_request(request_id, prompt_len, n=1, priority=0, arrival=None):
    prompt = [100 + i for i in range(prompt_len)]
    params = SamplingParams(n=n)
    arrival = float(len(request_id)) if arrival is None else arrival
    req = Request(request_id, prompt, params, priority=priority, arrival_time=arrival)
    req.pending_forks = [Request(f"{request_id}-{i}", prompt, params, priority=priority,
                                 arrival_time=arrival, parent_id=request_id, sample_index=i)
                         for i in range(1, n)]
    return req


def fake_sampled(sched, out, token=7):
    """What the model would return: one token per request that completed its tokens."""
    sampled = {r.request_id: [token] for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    sampled.update({child: [token + 1] for child in out.forked})
    return sampled


def step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, fake_sampled(sched, out, token))
    sched.check_integrity()
    return out


def scheduled(out):
    return [(r.request_id, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled]


def test_prefill_then_decode_with_exact_blocks():
    sched = make_scheduler()
    a = make_request("a", 6)
    sched.add_request(a)
    out = step(sched)
    assert scheduled(out) == [("a", 6)] and out.block_ids == {"a": [0, 1]}
    assert a.status is RUNNING and a.num_computed_tokens == 6 and a.output_token_ids == [7]
    assert a.first_scheduled_time is not None and a.first_token_time is not None
    out = step(sched, token=8)
    assert scheduled(out) == [("a", 1)] and out.block_ids == {"a": [0, 1]}
    assert a.output_token_ids == [7, 8] and a.num_computed_tokens == 7


def test_long_prompt_chunks_exactly_under_budget_8():
    sched = make_scheduler(budget=8)
    a = make_request("a", 20)
    sched.add_request(a)
    chunks, tables = [], []
    for _ in range(4):
        out = step(sched)
        chunks.append(out.num_scheduled_tokens["a"])
        tables.append(out.block_ids["a"])
    assert chunks == [8, 8, 4, 1]
    # the decode writes position 20, the first slot of a sixth block
    assert tables == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    assert a.output_token_ids == [7, 7]          # sampled only after the last chunk, then decode


def test_budget_shared_between_decode_and_new_prefills_decodes_first():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 3))
    step(sched)
    sched.add_request(make_request("b", 10))
    sched.add_request(make_request("c", 2))
    out = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 7)]          # c must wait: budget spent
    assert out.total_num_scheduled_tokens == 8
    out = step(sched)
    # b finishes its prompt, then c fits in what is left
    assert scheduled(out) == [("a", 1), ("b", 3), ("c", 2)]


def test_one_token_chunks_are_moved_before_longer_chunks():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("long", 3))
    sched.add_request(make_request("one", 1))
    out = step(sched)
    # scheduling order was long(3), one(1); the batch puts the 1-token request first
    assert scheduled(out) == [("one", 1), ("long", 3)]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 2))
    out = step(sched)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_preemption_newest_first_goes_to_front_and_recomputes():
    sched = make_scheduler(num_blocks=10)
    a, b, c = make_request("a", 12), make_request("b", 12), make_request("c", 12)
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    assert out.block_ids == {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7, 8]}
    sched.add_request(make_request("d", 1))
    out = step(sched)            # each decode needs a 4th block; only block 9 is free
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert out.preempted_request_ids == ["c"]
    assert out.block_ids == {"a": [0, 1, 2, 9], "b": [3, 4, 5, 8]}   # c's blocks freed tail first
    assert c.status is PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert not sched.kv_manager.has_blocks("c")
    assert [r.request_id for r in sched.waiting] == ["c", "d"]       # front, ahead of d
    assert sched.kv_manager.pool.free_block_ids() == [7, 6]
    # c needs 4 blocks for its 13 tokens, 2 free: it waits and d may not jump ahead
    out = step(sched)
    assert scheduled(out) == [("a", 1), ("b", 1)]
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    # c recomputes prompt + its earlier output token (13), then d; 1-token requests first
    assert scheduled(out) == [("b", 1), ("d", 1), ("c", 13)]
    assert out.block_ids["c"] == [7, 6, 9, 2]
    assert c.status is RUNNING and c.output_token_ids == [7, 7]


def test_request_that_is_newest_preempts_itself_and_stops():
    sched = make_scheduler(num_blocks=8, max_model_len=32)
    a, b = make_request("a", 7), make_request("b", 24)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)                                      # a: 2 blocks, b: 6 blocks, none free
    out = step(sched)   # a's pos 7 fits block 1; b's pos 24 needs a 7th block -> b is newest
    assert scheduled(out) == [("a", 1)]
    assert out.preempted_request_ids == ["b"] and b.status is PREEMPTED
    assert sched.kv_manager.num_free_blocks == 6


def test_priority_preempts_lowest_priority_even_if_already_scheduled():
    sched = make_scheduler(num_blocks=5, max_model_len=20, policy="priority")
    low = make_request("low", 6, priority=5)
    sched.add_request(low)
    step(sched)                                      # low: blocks [0, 1], 7 tokens
    high = make_request("high", 12, priority=0)
    sched.add_request(high)
    step(sched)                                      # low decodes pos 6, high gets [2, 3, 4]
    out = step(sched)   # low's pos 7 fits; high's pos 12 needs a block -> victim is low
    assert scheduled(out) == [("high", 1)]
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.preempted_request_ids == ["low"]
    assert out.block_ids == {"high": [2, 3, 4, 1]}
    assert low.status is PREEMPTED and list(sched.waiting) == [low]


def test_chunked_prefill_off_schedules_whole_prompts_only():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    sched.add_request(make_request("a", 4))
    step(sched)
    sched.add_request(make_request("b", 16))
    out = step(sched)
    assert scheduled(out) == [("a", 1)]               # 15 tokens left < 16: b waits whole
    sched.abort_request("a")
    out = step(sched)
    assert scheduled(out) == [("b", 16)]


def test_fork_shares_prompt_blocks_then_copy_on_write():
    sched = make_scheduler()
    parent = make_request("p", 6, n=3)
    sched.add_request(parent)
    assert sched.num_waiting == 1 and sched.get_request("p-2") is not None
    out = step(sched)
    assert scheduled(out) == [("p", 6)]
    assert out.forked == {"p-1": "p", "p-2": "p"}
    assert [c.request_id for c in out.forked_requests] == ["p-1", "p-2"]
    kv = sched.kv_manager
    assert kv.get_block_ids("p-1") == kv.get_block_ids("p-2") == [0, 1]
    assert kv.pool.ref_cnt(0) == kv.pool.ref_cnt(1) == 3
    c1, c2 = sched.get_request("p-1"), sched.get_request("p-2")
    assert c1.status is RUNNING and c1.num_computed_tokens == 6 and c1.output_token_ids == [8]
    assert parent.output_token_ids == [7] and parent.pending_forks == []
    out = step(sched)
    assert scheduled(out) == [("p", 1), ("p-1", 1), ("p-2", 1)]
    assert out.block_copies == [(1, 2), (1, 3)]       # the last sharer keeps block 1
    assert out.block_ids == {"p": [0, 2], "p-1": [0, 3], "p-2": [0, 1]}
    assert [kv.pool.ref_cnt(b) for b in range(4)] == [3, 1, 1, 1]


def test_fork_waits_for_last_chunk_of_prompt():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("p", 10, n=2))
    out = step(sched)
    assert out.forked == {} and sched.get_request("p-1").status is RequestStatus.WAITING
    out = step(sched)
    assert scheduled(out) == [("p", 2)] and out.forked == {"p-1": "p"}


def test_fork_siblings_reserve_sequence_slots():
    sched = make_scheduler(max_num_seqs=3)
    sched.add_request(make_request("p", 5, n=3))
    sched.add_request(make_request("q", 2))
    out = step(sched)
    assert scheduled(out) == [("p", 5)] and sched.num_running == 3 and sched.num_waiting == 1
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(make_request("big", 2, n=4))


def _abort_and_check(sched, request_id):
    req = sched.get_request(request_id)
    sched.abort_request(request_id)
    assert req.status is RequestStatus.FINISHED_ABORTED and req.finished_time is not None
    assert sched.get_request(request_id) is None
    assert not sched.kv_manager.has_blocks(request_id)
    sched.check_integrity()


def test_abort_in_every_state_frees_blocks():
    sched = make_scheduler(num_blocks=10, budget=8)
    sched.add_request(make_request("waiting", 3))
    _abort_and_check(sched, "waiting")

    sched.add_request(make_request("mid", 20))
    step(sched)
    assert sched.kv_manager.has_blocks("mid")
    _abort_and_check(sched, "mid")                     # running, mid chunked prefill

    sched.add_request(make_request("dec", 3))
    step(sched)
    step(sched)
    _abort_and_check(sched, "dec")                     # running, decoding

    sched.add_request(make_request("p", 6, n=3))
    _abort_and_check(sched, "p-1")                     # a fork not yet taken
    assert [c.request_id for c in sched.get_request("p").pending_forks] == ["p-2"]
    child = sched.get_request("p-2")
    _abort_and_check(sched, "p")                       # parent takes its pending fork along
    assert child.status is RequestStatus.FINISHED_ABORTED

    sched.add_request(make_request("q", 6, n=2))
    step(sched)
    _abort_and_check(sched, "q-1")                     # forked, running child
    assert all(sched.kv_manager.pool.ref_cnt(b) == 1 for b in sched.kv_manager.get_block_ids("q"))
    _abort_and_check(sched, "q")
    sched.abort_request("q")                           # unknown / finished ids: no-op
    assert sched.kv_manager.num_free_blocks == 10 and not sched.has_unfinished_requests()


def test_abort_preempted_request_and_between_schedule_and_update():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", 7))
    sched.add_request(make_request("b", 24))
    step(sched)
    step(sched)                                        # b preempted (see test above)
    assert sched.get_request("b").status is PREEMPTED
    _abort_and_check(sched, "b")

    out = sched.schedule()
    a = sched.get_request("a")
    sched.abort_request("a")                           # while the step "runs"
    assert sched.update_from_output(out, {"a": [1]}) == []
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 2   # untouched by the update
    assert sched.kv_manager.num_free_blocks == 8
    sched.check_integrity()


def test_update_rejects_inconsistent_samples_without_changing_anything():
    sched = make_scheduler(budget=8)
    a = make_request("a", 20)
    sched.add_request(a)
    out = sched.schedule()
    with pytest.raises(ValueError, match="'a'"):
        sched.update_from_output(out, {"a": [5]})      # mid-prefill: nothing to sample
    assert a.num_computed_tokens == 0 and a.output_token_ids == []
    sched.update_from_output(out, {})
    sched.update_from_output(sched.schedule(), {})
    out = sched.schedule()                             # last chunk
    with pytest.raises(ValueError, match="'a'"):
        sched.update_from_output(out, {})
    assert a.num_computed_tokens == 16


def test_add_request_validation():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 3, n=2))
    with pytest.raises(ValueError, match="'a'"):
        sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="'a-1'"):
        sched.add_request(make_request("a-1", 3))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 17))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("empty", 0))


def test_block_size_mismatch_rejected():
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=16, block_size=8), KVCacheManager(10, BLOCK))


def test_request_outgrowing_the_whole_cache_fails_loudly_instead_of_hanging():
    sched = make_scheduler(num_blocks=3, max_model_len=32)     # cache holds 12 tokens
    assert sched.max_tokens_in_cache == 12
    with pytest.raises(ValueError, match="KV cache holds"):
        sched.add_request(make_request("big", 13))
    a = make_request("a", 11)
    sched.add_request(a)
    step(sched)
    step(sched)                                   # 13 tokens now: the engine failed to stop it
    # it preempts itself (alone) and could never be admitted again
    with pytest.raises(RuntimeError, match="can never be scheduled"):
        sched.schedule()
    assert a.status is RequestStatus.PREEMPTED and sched.kv_manager.num_free_blocks == 3


def test_check_integrity_catches_lost_request():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    sched.waiting.pop()                                 # dropped on the floor
    with pytest.raises(AssertionError, match="'a'"):
        sched.check_integrity()


def test_check_integrity_catches_waiting_request_holding_blocks():
    sched = make_scheduler()
    a = make_request("a", 3)
    sched.add_request(a)
    sched.kv_manager.allocate_slots(a, 3)
    with pytest.raises(AssertionError, match="holds blocks"):
        sched.check_integrity()


def test_decode_lookahead_slots_exact_blocks_and_unused_slots_trimmed():
    # multi-step decoding: a decode with 3 lookahead tokens gets 1 + 3 slots; the step returns
    # 4 tokens (all but the last fed back in, so computed) or fewer (unused blocks go back)
    sched = make_scheduler(num_blocks=10)
    a = make_request("a", 6)
    sched.add_request(a)
    step(sched)                                   # prefill: 6 tokens + 1 sampled = 7
    a.num_lookahead_tokens = 3
    out = sched.schedule()
    assert scheduled(out) == [("a", 4)] and out.num_lookahead_tokens == {"a": 3}
    assert out.num_query_tokens("a") == 1
    assert out.block_ids == {"a": [0, 1, 2]}      # positions 6..9: blocks 1 and 2
    sched.update_from_output(out, {"a": [8, 9, 10, 11]})
    assert a.num_computed_tokens == 10 and a.output_token_ids == [7, 8, 9, 10, 11]
    sched.check_integrity()
    a.num_lookahead_tokens = 7
    out = sched.schedule()                        # positions 10..17: blocks up to 4
    assert scheduled(out) == [("a", 8)] and out.block_ids == {"a": [0, 1, 2, 3, 4]}
    sched.update_from_output(out, {"a": [12, 13]})   # stopped after 2 tokens
    assert a.num_computed_tokens == 12 and a.num_tokens == 13
    assert sched.kv_manager.get_block_ids("a") == [0, 1, 2, 3]   # block 4 held no token
    sched.check_integrity()
    with pytest.raises(ValueError, match="slots ahead"):
        a.num_lookahead_tokens = 1
        out = sched.schedule()
        sched.update_from_output(out, {"a": [1, 2, 3]})


def test_decode_lookahead_capped_by_budget_and_dropped_before_preempting():
    sched = make_scheduler(num_blocks=4, budget=6)
    a, b = make_request("a", 6), make_request("b", 2)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    step(sched)                                   # a: 7 tokens (blocks 0, 1), b: 3 (block 2)
    a.num_lookahead_tokens = b.num_lookahead_tokens = 8
    out = sched.schedule()
    # a (computed 7) with 5 lookahead slots (the budget's 6 less its own token) would need
    # blocks 2 and 3, one more than the pool's last free block: it drops its lookahead instead
    # of preempting b; b then takes its own token + 4 (the budget left), in that free block
    assert out.preempted_request_ids == []
    assert scheduled(out) == [("a", 1), ("b", 5)] and out.num_lookahead_tokens == {"b": 4}
    assert out.block_ids == {"a": [0, 1], "b": [2, 3]}
    sched.update_from_output(out, {"a": [1], "b": [2, 3, 4, 5, 6]})
    assert b.num_computed_tokens == 7 and b.num_tokens == 8 and a.num_computed_tokens == 8
    sched.check_integrity()
