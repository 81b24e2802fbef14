"""Random engine loops: add / step / abort / finish with check_integrity() after every operation,
and at the end every request finished with all blocks back in the pool."""
import itertools

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvforge.engine.request import Request, RequestStatus
from kvforge.kvcache.kv_manager import KVCacheManager, cdiv
from kvforge.sampling_params import SamplingParams
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.scheduler import Scheduler

BLOCK = 4
MAX_MODEL_LEN = 32


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["fcfs", "priority", "mlfq"]), chunked=st.booleans(),
                num_blocks=st.integers(8, 14), budget=st.integers(1, 40),
                max_num_seqs=st.integers(3, 6), prefill_ahead=st.integers(0, 2))
    def setup(self, policy, chunked, num_blocks, budget, max_num_seqs, prefill_ahead=0):
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      enable_chunked_prefill=chunked, max_model_len=MAX_MODEL_LEN,
                                      policy=policy, block_size=BLOCK,
                                      prefill_ahead=prefill_ahead)
        self.sched = Scheduler(self.config, KVCacheManager(num_blocks, BLOCK))
        self.all_requests: list[Request] = []
        self.ids = itertools.count()

    @rule(prompt_len=st.integers(1, 20), n=st.integers(1, 3), priority=st.integers(0, 2),
          max_tokens=st.integers(1, 8))
    def add(self, prompt_len, n, priority, max_tokens):
        rid = f"r{next(self.ids)}"
        prompt = list(range(prompt_len))
        params = SamplingParams(n=n, max_tokens=max_tokens)
        req = Request(rid, prompt, params, priority=priority)
        req.pending_forks = [Request(f"{rid}-{i}", prompt, params, priority=priority,
                                     arrival_time=req.arrival_time, parent_id=rid, sample_index=i)
                             for i in range(1, n)]
        self.sched.add_request(req)
        self.all_requests += [req, *req.pending_forks]

    @rule(token=st.integers(0, 1000))
    def step(self, token):
        sched, config = self.sched, self.config
        out = sched.schedule()
        lens = [out.num_scheduled_tokens[r.request_id] for r in out.scheduled]
        assert sum(lens) <= config.max_num_batched_tokens
        # prefilled-ahead requests ride beyond the sequence slots, whole prompts only
        ahead = [r for r in out.scheduled if r.request_id in sched.parked]
        assert len(lens) - len(ahead) <= config.max_num_seqs and all(n > 0 for n in lens)
        assert len(ahead) <= config.prefill_ahead
        assert all(r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
                   for r in ahead)
        assert lens == sorted(lens, key=lambda n: n != 1), f"decodes not first: {lens}"
        for r in out.scheduled:
            n = out.num_scheduled_tokens[r.request_id]
            assert r.num_computed_tokens + n <= r.num_tokens
            assert len(out.block_ids[r.request_id]) >= cdiv(r.num_computed_tokens + n, BLOCK)
            if not config.enable_chunked_prefill and n > 1:
                # the whole rest at once; it starts at 0 unless a prefix-cache hit skipped some
                assert r.num_computed_tokens + n == r.num_tokens
                assert r.num_computed_tokens == 0 or sched.kv_manager.prefix_cache is not None
        sched.check_integrity()
        sampled = {r.request_id: [token] for r in out.scheduled
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens}
        sampled.update({child: [token + 1] for child in out.forked})
        for req in sched.update_from_output(out, sampled):
            # the engine's stop check
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= MAX_MODEL_LEN:
                sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), stop=st.booleans())
    def end_one(self, data, stop):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        if stop:
            self.sched.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        else:
            self.sched.abort_request(rid)

    @invariant()
    def integrity(self):
        self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # a budget of 1 token a step runs ~30 requests one token at a time, preemptions redo
        # prompts: bound the steps by the work (x8 for recompute), not by a fixed count
        work = sum(r.num_prompt_tokens + r.max_tokens for r in self.all_requests)
        for _ in range(8 * work + 100):
            if not self.sched.has_unfinished_requests():
                break
            self.step(token=1)
        assert not self.sched.has_unfinished_requests(), "requests never finished (livelock)"
        assert all(r.is_finished for r in self.all_requests)
        kv = self.sched.kv_manager
        assert kv.num_free_blocks == kv.num_blocks and kv.request_ids() == []
        kv.check_integrity()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
