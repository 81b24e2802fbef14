"""Random interleavings of admit (match + lock), compute (insert), fork, finish (unlock) and
evict on a KVCacheManager with the prefix cache on; check_integrity() after every operation and
no block is ever both free and referenced."""
import itertools

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvforge.engine.request import Request
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.sampling_params import SamplingParams

B = 4
NUM_BLOCKS = 12
# a few shared heads so that prompts overlap at, inside and across block boundaries
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5], []]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, B, enable_prefix_caching=True)
        self.running: dict[str, Request] = {}
        self.ids = itertools.count()

    @rule(head=st.sampled_from(HEADS), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, head, tail):
        prompt = head + tail or [0]
        req = Request(f"r{next(self.ids)}", prompt, SamplingParams())
        prefix = self.kv.match_prefix(req)
        assert prefix.num_tokens % B == 0 and prefix.num_tokens <= len(prompt) - 1
        assert self.kv.prefix_match_length(req) == prefix.num_tokens
        slots = self.kv.allocate_slots(req, len(prompt) - prefix.num_tokens, prefix)
        if slots is None:
            assert not self.kv.has_blocks(req.request_id)
            return
        table = self.kv.get_block_ids(req.request_id)
        assert table[:len(prefix.block_ids)] == prefix.block_ids
        req.num_computed_tokens = prefix.num_tokens
        self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute(self, data):
        """The forward ran: all scheduled tokens have KV now, full blocks join the tree."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_computed_tokens < req.num_tokens:
            return
        req.append_output_token(token)
        if self.kv.allocate_slots(req, 1) is not None:
            req.num_computed_tokens += 1
            self.kv.cache_computed_blocks(req)
        else:
            req.all_token_ids.pop()
            req.output_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        """As the scheduler does: fork once the parent's tokens are computed, and the child
        offers its (shared) blocks to the cache in the same step as the parent."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running[rid]
        if parent.num_computed_tokens < parent.num_tokens:
            return
        child = Request(f"{rid}-f{next(self.ids)}", parent.prompt_token_ids, SamplingParams())
        for t in parent.output_token_ids:
            child.append_output_token(t)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(rid, child.request_id)
        self.kv.cache_computed_blocks(child)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]
        self.kv.free(rid)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n):
        cache = self.kv.prefix_cache
        before = cache.num_evictable_blocks
        evicted = cache.evict(n)
        assert len(evicted) >= min(n, before) or not cache.tree._heap
        referenced = {b for rid in self.running for b in self.kv.get_block_ids(rid)}
        assert not referenced & set(evicted), "evicted a block a request still uses"

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        free = set(self.kv.pool.free_block_ids())
        tables = {b for rid in self.running for b in self.kv.get_block_ids(rid)}
        cached = set(self.kv.prefix_cache.block_refs())
        assert not free & tables, f"blocks {sorted(free & tables)} free and in a block table"
        assert not free & cached, f"blocks {sorted(free & cached)} free and cached"
        assert free | tables | cached == set(range(NUM_BLOCKS)), "a block is nowhere"
        if not self.running:
            assert self.kv.num_free_blocks == NUM_BLOCKS       # cached blocks are free capacity


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
