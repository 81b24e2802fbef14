"""The random scheduler machine of test_scheduler_stateful (its prompts all share prefixes)
rerun with the prefix cache on and the LPM policy in the mix: check_integrity() after every
operation, every request finishes, every block ends free or evictable with no lock left."""
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import initialize

import tests.sched.test_scheduler_stateful as base
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sched.scheduler import Scheduler


class CachedSchedulerMachine(base.SchedulerMachine):
    @initialize(policy=st.sampled_from(["fcfs", "priority", "lpm"]), chunked=st.booleans(),
                num_blocks=st.integers(8, 14), budget=st.integers(1, 40),
                max_num_seqs=st.integers(3, 6), prefill_ahead=st.integers(0, 2))
    def setup(self, policy, chunked, num_blocks, budget, max_num_seqs, prefill_ahead):
        base.SchedulerMachine.setup(self, policy, chunked, num_blocks, budget, max_num_seqs,
                                    prefill_ahead)
        self.sched = Scheduler(self.config, KVCacheManager(num_blocks, base.BLOCK,
                                                           enable_prefix_caching=True))

    def teardown(self):
        super().teardown()
        if hasattr(self, "sched"):
            cache = self.sched.kv_manager.prefix_cache
            assert all(n.lock_ref == 0 for n in cache.tree.nodes())


TestCachedSchedulerMachine = CachedSchedulerMachine.TestCase
TestCachedSchedulerMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
