"""Skip-join MLFQ: join level by estimated work, demotion at the quantum, promotion after the
starvation bound, priority order within a level, and preemption for higher-ranked waiters."""
import pytest

from kvforge.engine.request import Request, RequestStatus
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.mlfq import MLFQConfig, MLFQRequestQueue
from kvforge.sched.queues import available_policies, create_request_queue
from kvforge.sched.scheduler import Scheduler

# quanta 4, 8, 16, unbounded
CFG = MLFQConfig(num_levels=4, base_quantum=4, quantum_growth=2, starvation_steps=3,
                 prefill_weight=1.0)


def make_request(request_id, prompt_len=2, priority=0, max_tokens=64):
    return Request(request_id, list(range(1, prompt_len + 1)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority,
                   arrival_time=0.0)


def ids(requests):
    return [r.request_id for r in requests]


def charge(queue, request, tokens):
    queue.on_step_scheduled({request.request_id: tokens}, {request.request_id: request})


def test_registered_and_config_validated():
    assert "mlfq" in available_policies()
    assert isinstance(create_request_queue("mlfq"), MLFQRequestQueue)
    assert SchedulerConfig(policy="mlfq").policy == "mlfq"
    with pytest.raises(ValueError, match="quantum_growth"):
        MLFQConfig(quantum_growth=1)
    with pytest.raises(ValueError, match="num_levels"):
        MLFQConfig(num_levels=0)
    assert [CFG.quantum(lv) for lv in range(4)] == [4, 8, 16, float("inf")]
    assert MLFQConfig().quanta == (8, 32, 128, 512) and MLFQConfig().num_levels == 5
    explicit = MLFQConfig(quanta=[5, 40])
    assert (explicit.num_levels, explicit.quanta, explicit.base_quantum) == (3, (5, 40), 5)
    assert [explicit.quantum(lv) for lv in range(3)] == [5, 40, float("inf")]
    for bad in ([], [8, 8], [16, 4], [0, 4], [4.5, 8], "64,256"):
        with pytest.raises(ValueError, match="quanta"):
            MLFQConfig(quanta=bad)
    for bad in (0, -0.5, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="prefill_weight"):
            MLFQConfig(prefill_weight=bad)


def test_skip_join_by_estimated_prefill_work():
    q = MLFQRequestQueue(CFG)
    # work 3 < 4 -> level 0; 4 -> level 1 (quantum must exceed it); 12 -> 2; 16 and 500 -> last
    reqs = {n: make_request(f"p{n}", prompt_len=n) for n in (3, 4, 12, 16, 500)}
    for r in reversed(list(reqs.values())):
        q.add(r)
    assert [q.level_of(reqs[n]) for n in (3, 4, 12, 16, 500)] == [0, 1, 2, 3, 3]
    # shortest first regardless of arrival; equal level keeps arrival order
    assert ids(q) == ["p3", "p4", "p12", "p500", "p16"]


def test_skip_join_counts_only_uncached_work():
    q = MLFQRequestQueue(CFG)
    q.bind_prefix_matcher(lambda r: 16)          # 16 of its 18 tokens are cached
    r = make_request("hit", prompt_len=18)
    q.add(r)
    assert q.estimated_work(r) == 2 and q.level_of(r) == 0


def test_demotion_when_the_quantum_is_used_up():
    q = MLFQRequestQueue(CFG)
    r = make_request("r", prompt_len=1)
    q.add(r)
    assert q.pop() is r and q.level_of(r) == 0
    charge(q, r, 3)
    assert q.level_of(r) == 0                    # 3 < quantum 4
    charge(q, r, 1)
    assert q.level_of(r) == 1                    # used up 4: demoted, charge restarts
    for _ in range(7):
        charge(q, r, 1)
    assert q.level_of(r) == 1
    charge(q, r, 1)
    assert q.level_of(r) == 2 and q.num_demotions == 2
    charge(q, r, 1000)
    charge(q, r, 1000)
    assert q.level_of(r) == 3                    # the last level never demotes further


def test_prefill_weight_counts_prompt_tokens_as_cheaper_than_decodes():
    # weight 1/4: a 10-token prompt is 2.5 of work (level 0, quantum 4); 20 tokens is 5 (level 1)
    cfg = MLFQConfig(num_levels=4, base_quantum=4, quantum_growth=2, prefill_weight=0.25)
    q = MLFQRequestQueue(cfg)
    short, long_ = make_request("p10", prompt_len=10), make_request("p20", prompt_len=20)
    q.add(long_)
    q.add(short)
    assert (q.level_of(short), q.level_of(long_)) == (0, 1)
    assert q.estimated_work(short) == 2.5
    assert q.pop() is short
    # a 4-token chunk that does not reach the prompt's end: 4 x 0.25 = 1
    charge(q, short, 4)
    assert q._ranks["p10"].work_in_level == 1.0
    # the chunk that ends the prompt samples a token: + 1 + 5 x 0.25
    short.num_computed_tokens = 4
    charge(q, short, 6)
    assert q._ranks["p10"].work_in_level == 3.25 and q.level_of(short) == 0
    short.num_computed_tokens = 10
    short.append_output_token(5)
    charge(q, short, 1)                          # a decode costs a whole step: 4.25 >= 4,
    # demoted, to the back of level 1
    assert q.level_of(short) == 1 and q._ranks["p10"].work_in_level == 0
    assert q._ranks["p10"].order > q._ranks["p20"].order


def test_promotion_after_starvation_bound():
    q = MLFQRequestQueue(CFG)
    long_ = make_request("long", prompt_len=100)
    q.add(long_)
    shorts = [make_request(f"s{i}", prompt_len=1) for i in range(3)]
    for s in shorts:
        q.add(s)
    assert q.level_of(long_) == 3 and q.peek() is shorts[0]
    q.on_step_scheduled({}, {})
    q.on_step_scheduled({}, {})
    assert q.level_of(long_) == 3                # waited 2 < 3 steps
    q.on_step_scheduled({}, {})
    assert q.level_of(long_) == 0 and q.num_promotions == 1
    # promoted to the top level, behind the level-0 requests that were already there
    assert ids(q) == ["s0", "s1", "s2", "long"]
    assert q.pop() is shorts[0]                  # popped requests stop aging
    for _ in range(5):
        q.on_step_scheduled({}, {})
    assert q.level_of(shorts[0]) == 0 and q.num_promotions == 1


def test_priority_orders_within_a_level_never_across():
    q = MLFQRequestQueue(CFG)
    low = make_request("low", prompt_len=1, priority=5)
    high = make_request("high", prompt_len=1, priority=-3)
    high_but_long = make_request("high-long", prompt_len=10, priority=-9)
    for r in (low, high_but_long, high):
        q.add(r)
    assert ids(q) == ["high", "low", "high-long"]
    # preempted requests go back to the front of their level
    victim = make_request("back", prompt_len=1, priority=5)
    q.add(victim)
    assert q.pop() is high and q.pop() is low
    q.remove(victim)
    q.prepend(victim)
    assert ids(q) == ["back", "high-long"]


def test_kv_victim_is_the_lowest_ranked_running():
    q = MLFQRequestQueue(CFG)
    a, b, c = (make_request(x, prompt_len=n) for x, n in (("a", 1), ("b", 20), ("c", 2)))
    for r in (a, b, c):
        q.add(r)
    running = [q.pop(), q.pop(), q.pop()]
    assert ids(running) == ["a", "c", "b"]
    assert q.select_preemption_victim(running) is b
    q.order_running(running)
    assert ids(running) == ["a", "c", "b"]
    # equal level and priority: the later into the level goes first, wherever it runs
    d = make_request("d", prompt_len=20)
    q.add(d)
    running.insert(0, q.pop())
    assert ids(running) == ["d", "a", "c", "b"]
    assert q.select_preemption_victim(running) is d
    assert q.requests_to_yield(running, 0) == []          # nobody waits
    q.add(make_request("new", prompt_len=1))
    assert ids(q.requests_to_yield(running, 0)) == ["d"]


def test_a_request_near_its_max_tokens_is_not_asked_to_yield():
    q = MLFQRequestQueue(CFG)                     # level 0's quantum: 4
    ending, long_ = make_request("ending", max_tokens=6), make_request("long", max_tokens=60)
    for r in (ending, long_):
        q.add(r)
    running = [q.pop(), q.pop()]
    for r in running:
        r.num_computed_tokens = r.num_tokens
        charge(q, r, 4)                           # both used up level 0
    assert q.level_of(ending) == q.level_of(long_) == 1
    ending.append_output_token(5)                 # 1 of 6 out: 5 decodes left > 4
    q.add(make_request("new"))
    assert ids(q.requests_to_yield(running, 0)) == ["long"]        # the lowest ranked first
    q.add(make_request("new2"))
    assert ids(q.requests_to_yield(running, 0)) == ["long", "ending"]
    ending.append_output_token(5)                 # 2 of 6: 4 left, within level 0's quantum
    assert ids(q.requests_to_yield(running, 0)) == ["long"]


def test_multi_step_decode_is_charged_one_step_per_token():
    q = MLFQRequestQueue(MLFQConfig(quanta=[8, 64], prefill_weight=0.1))
    r = make_request("r", prompt_len=3)
    q.add(r)
    q.pop()
    r.num_computed_tokens = 3
    r.append_output_token(5)                      # decoding: 1 token left to compute
    # a 4-step call: 1 + 3 lookahead slots, 4 tokens sampled -> 4 decode steps of work
    q.on_step_scheduled({"r": 4}, {"r": r}, {"r": 3})
    assert q._ranks["r"].work_in_level == 4
    q.on_step_scheduled({"r": 4}, {"r": r}, {"r": 3})
    assert q.level_of(r) == 1                     # 8 decodes use up the quantum of 8


# ---- through the scheduler ---------------------------------------------------------------
def make_scheduler(max_num_seqs=2, num_blocks=64, config=CFG):
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                                      max_model_len=256, policy="mlfq", block_size=4), kv)
    sched.waiting.config = config
    return sched


def run_step(sched, next_token=7):
    out = sched.schedule()
    sampled = {r.request_id: [next_token] for r in out.scheduled
               if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
    sched.update_from_output(out, sampled)
    sched.check_integrity()
    return out


def test_short_arrival_preempts_a_demoted_long_job_and_it_resumes():
    sched = make_scheduler(max_num_seqs=1)
    long_ = make_request("long", prompt_len=2)
    sched.add_request(long_)
    for _ in range(6):                     # 2-token prefill + 5 decodes: 7 >= quantum 4
        run_step(sched)
    assert sched.waiting.level_of(long_) == 1
    short = make_request("short", prompt_len=2, max_tokens=2)
    sched.add_request(short)
    out = run_step(sched)
    assert out.preempted_request_ids == ["long"]
    assert ids(out.scheduled) == ["short"] and long_.status is RequestStatus.PREEMPTED
    assert long_.num_preemptions == 1
    run_step(sched)                        # short's second token: it is done
    sched.finish_request("short", RequestStatus.FINISHED_LENGTH)
    out = run_step(sched)
    assert ids(out.scheduled) == ["long"] and long_.num_computed_tokens == long_.num_tokens - 1
    sched.finish_request("long", RequestStatus.FINISHED_LENGTH)
    sched.check_integrity()
    assert sched.kv_manager.num_free_blocks == 64 and not sched.waiting._ranks


def test_equal_level_waiter_does_not_preempt():
    sched = make_scheduler(max_num_seqs=1)
    first = make_request("first", prompt_len=2)
    sched.add_request(first)
    run_step(sched)
    sched.add_request(make_request("second", prompt_len=2))
    out = run_step(sched)
    assert not out.preempted_request_ids and ids(out.scheduled) == ["first"]


def test_fcfs_never_yields():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1,
                                      max_model_len=256, block_size=4), kv)
    sched.add_request(make_request("long", prompt_len=2))
    for _ in range(10):
        run_step(sched)
    sched.add_request(make_request("short", prompt_len=2))
    out = run_step(sched)
    assert not out.preempted_request_ids and ids(out.scheduled) == ["long"]
