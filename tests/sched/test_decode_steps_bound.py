"""Multi-step decoding with requests waiting: the scheduler bounds k so that no admission or
MLFQ preemption comes later (in model steps) than it would one step at a time."""
from kvforge.engine.decode_steps import plan_decode_steps
from kvforge.engine.request import Request, RequestStatus
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.mlfq import MLFQConfig
from kvforge.sched.scheduler import Scheduler

# quanta 4, 8, unbounded; starvation after 100 model steps
CFG = MLFQConfig(quanta=[4, 8], starvation_steps=100, prefill_weight=0.5)


def make_request(request_id, max_tokens=64, prompt_len=2):
    return Request(request_id, list(range(1, prompt_len + 1)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0)


def make_scheduler(policy, max_num_seqs=1):
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                                      max_model_len=256, policy=policy, block_size=4,
                                      mlfq=CFG if policy == "mlfq" else None), kv)
    return sched


def run_step(sched):
    out = sched.schedule()
    sampled = {}
    for r in out.scheduled:
        ahead = out.num_lookahead_tokens.get(r.request_id, 0)
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] - ahead == r.num_tokens:
            sampled[r.request_id] = [7] * (1 + ahead)
    sched.update_from_output(out, sampled)
    sched.check_integrity()
    return out


class _AnyBatch:
    """plan_decode_steps' model argument: the compiled stack takes any batch size."""

    @staticmethod
    def can_decode_steps(num_seqs):
        return True


def test_no_bound_when_nothing_waits_and_one_step_when_a_slot_is_free():
    for policy in ("fcfs", "mlfq"):
        sched = make_scheduler(policy, max_num_seqs=2)
        sched.add_request(make_request("a"))
        run_step(sched)
        assert sched.decode_steps_allowed() is None              # nothing waiting
        sched.add_request(make_request("b"))
        sched.add_request(make_request("c"))
        run_step(sched)                                          # b joins: both slots taken
        assert sched.num_waiting == 1
        sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
        assert sched.decode_steps_allowed() == 1                 # c is admitted next step


def test_fcfs_with_every_slot_taken_is_bounded_by_the_first_finish_only():
    sched = make_scheduler("fcfs")
    running = make_request("running", max_tokens=20)
    sched.add_request(running)
    run_step(sched)
    sched.add_request(make_request("waiting"))
    assert sched.decode_steps_allowed() is None          # the policy never preempts
    # the call still ends where the running request reaches max_tokens (19 left, k <= 8)
    assert plan_decode_steps(sched.running, None, 8, 256, _AnyBatch) == 8
    running.output_token_ids.extend([7] * 16)
    running.all_token_ids.extend([7] * 16)
    running.num_computed_tokens += 16
    assert plan_decode_steps(sched.running, sched.decode_steps_allowed(), 8, 256,
                             _AnyBatch) == 3


def test_mlfq_bound_is_the_quantum_left_before_a_waiter_outranks_the_runner():
    sched = make_scheduler("mlfq")
    queue = sched.waiting
    long_ = make_request("long", max_tokens=100)
    sched.add_request(long_)
    run_step(sched)                                  # prefill: 1 sample + 1 prompt token x 0.5
    assert queue.level_of(long_) == 0 and queue._ranks["long"].work_in_level == 1.5
    sched.add_request(make_request("short", max_tokens=100))    # level 0 too: equal rank
    # long yields once demoted (level 1 < short's 0): ceil(4 - 1.5) = 3 decode steps away
    assert sched.decode_steps_allowed() == 3
    k = plan_decode_steps(sched.running, sched.decode_steps_allowed(), 8, 256, _AnyBatch)
    assert k == 3
    out = run_step(sched)
    assert out.num_lookahead_tokens == {"long": 2} and long_.num_output_tokens == 4
    assert queue.level_of(long_) == 1                # demoted on the last of the 3 steps
    assert sched.decode_steps_allowed() == 1         # the short waiter preempts it now
    out = run_step(sched)
    assert out.preempted_request_ids == ["long"] and [r.request_id for r in out.scheduled] == [
        "short"]


def test_mlfq_does_not_bound_for_waiters_that_never_outrank_the_runner():
    sched = make_scheduler("mlfq")
    queue = sched.waiting
    first = make_request("first", max_tokens=100)
    sched.add_request(first)
    run_step(sched)
    for _ in range(3):
        run_step(sched)
    assert queue.level_of(first) == 1
    # a 20-token prompt is 10 of work: it joins level 2, below first, and never preempts it
    late = make_request("late", max_tokens=100, prompt_len=20)
    sched.add_request(late)
    assert queue.level_of(late) == 2
    # only its starvation promotion could: 100 model steps minus what it waited so far
    assert sched.decode_steps_allowed() == 100
    run_step(sched)
    assert sched.decode_steps_allowed() == 99


def test_mlfq_ignores_a_runner_that_ends_within_the_first_quantum():
    sched = make_scheduler("mlfq")
    sched.add_request(make_request("ending", max_tokens=5))   # 4 decodes left after prefill
    run_step(sched)
    sched.add_request(make_request("waiting"))
    assert sched.decode_steps_allowed() is None      # it frees its slot at max_tokens anyway


def test_waiting_ages_by_model_steps():
    sched = make_scheduler("mlfq")
    sched.add_request(make_request("runner", max_tokens=100))
    run_step(sched)
    late = make_request("late", max_tokens=100, prompt_len=20)
    sched.add_request(late)
    sched.running[0].num_lookahead_tokens = 3        # a 4-step call
    run_step(sched)
    assert sched.waiting._ranks["late"].steps_waited == 4


def test_mlfq_charges_an_interrupted_call_for_the_steps_it_ran():
    """A k-step call that returns fewer tokens (an arrival interrupted it) is charged for the
    steps it ran: ranks, demotions and the waiting requests' age equal a scheduler that
    planned that many steps; charged k, "a" would have left level 0 (quantum 4)."""
    def ranks(sched):
        q = sched.waiting
        return {rid: (r.level, r.work_in_level, r.steps_waited) for rid, r in q._ranks.items()}

    runs = {}
    for planned in (4, 1):
        sched = make_scheduler("mlfq", max_num_seqs=1)
        sched.add_request(make_request("a"))
        run_step(sched)                                  # prefill: 1 + 0.5 of work at level 0
        sched.add_request(make_request("b"))             # waits: the only slot is taken
        a = sched.running[0]
        a.num_lookahead_tokens = planned - 1
        out = sched.schedule()
        assert out.num_lookahead_tokens.get("a", 0) == planned - 1
        sched.update_from_output(out, {"a": [7]})        # one step ran
        sched.check_integrity()
        runs[planned] = (ranks(sched), sched.waiting.num_demotions, a.num_computed_tokens)
    assert runs[4] == runs[1]
    assert runs[1][0]["a"][:2] == (0, 2.5) and runs[1][1] == 0
