"""The prefix cache as the KV manager uses it: a RadixTree plus which request locks what.

Life of a request with the cache on:

    admission   match(request) -> MatchResult    longest cached prefix in whole blocks, at most
                                                 num_tokens - 1 tokens (the last token is always
                                                 computed so that its logits exist)
                acquire(rid, match)              lock the matched node; the block table takes a
                                                 reference on each matched block (KV manager)
    each step   cache(rid, tokens, table, n)     full blocks of the n computed tokens join the
                                                 tree; the request's lock moves to the new node
    fork        fork(parent, child)              the child locks what its parent locks
    end         release(rid)                     unlock (blocks stay cached, now evictable)

A request locks exactly one node (the deepest it matched or inserted), which pins the whole
path, so every cached block a request's table may reference is unevictable while it runs.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.radix_tree import MatchResult, RadixNode, RadixTree


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PrefixCacheStats:
    """Counters since the engine started (read by the engine stats and ``/metrics``).

    A query is one admission of a request (a preempted request re-admitted queries again);
    ``query_tokens`` are the tokens it needed KV for, ``hit_tokens`` those served from the cache.
    """

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    cached_blocks: int = 0          # gauge: blocks held by the tree now
    evictable_blocks: int = 0       # gauge: of which unlocked (count as free capacity)

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens served from the cache (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.tree = RadixTree(pool, block_size)
        self.block_size = block_size
        self._stats = PrefixCacheStats()
        self._locked: dict[str, RadixNode] = {}       # request id -> the node it locks
        self._num_cached_blocks: dict[str, int] = {}  # request id -> its blocks known cached

    @property
    def stats(self) -> PrefixCacheStats:
        self._stats.cached_blocks = self.tree.num_cached_blocks
        self._stats.evictable_blocks = self.tree.num_evictable_blocks
        return self._stats

    @property
    def num_evictable_blocks(self) -> int:
        return self.tree.num_evictable_blocks

    # ---- request life --------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> MatchResult:
        # never the last token: its forward pass yields the logits of the next sample
        return self.tree.match_prefix(token_ids[:max(0, len(token_ids) - 1)])

    def match_length(self, token_ids: Sequence[int]) -> int:
        """Read-only ``match`` length (for cache-aware queue policies)."""
        return self.tree.match_length(token_ids[:max(0, len(token_ids) - 1)])

    def acquire(self, request_id: str, match: MatchResult) -> None:
        if request_id in self._locked:
            raise ValueError(f"request {request_id!r} already holds a prefix-cache lock")
        self.tree.lock(match.node)
        self._locked[request_id] = match.node
        self._num_cached_blocks[request_id] = len(match.block_ids)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self._stats.queries += 1
        self._stats.query_tokens += num_tokens
        self._stats.hit_tokens += num_hit_tokens

    def cache(self, request_id: str, token_ids: Sequence[int], block_table: Sequence[int],
              num_computed_tokens: int) -> None:
        """Insert the request's full computed blocks not yet cached; move its lock down."""
        num_full = num_computed_tokens // self.block_size
        if num_full <= self._num_cached_blocks.get(request_id, 0):
            return
        result = self.tree.insert(token_ids[:num_full * self.block_size], block_table[:num_full])
        self.tree.lock(result.node)                  # lock the new node before unlocking the old
        old = self._locked.get(request_id)
        if old is not None:
            self.tree.unlock(old)
        self._locked[request_id] = result.node
        self._num_cached_blocks[request_id] = num_full

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child locks what its parent locks. Blocks both tables share that are computed but
        not cached yet must be offered (``cache``) by both in the same step, as the scheduler
        does right after a fork, so that the child's lock covers them too."""
        node = self._locked.get(parent_id)
        if node is None:
            return
        self.tree.lock(node)
        self._locked[child_id] = node
        self._num_cached_blocks[child_id] = self._num_cached_blocks[parent_id]

    def release(self, request_id: str) -> None:
        """Unlock whatever the request locks; unknown ids are ignored (idempotent)."""
        node = self._locked.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if node is not None:
            self.tree.unlock(node)

    def evict(self, num_blocks: int) -> list[int]:
        evicted = self.tree.evict(num_blocks)
        self._stats.evicted_blocks += len(evicted)
        return evicted

    # ---- invariants ----------------------------------------------------------------------
    def block_refs(self) -> Counter:
        return self.tree.block_refs()

    def check_integrity(self, block_tables: dict[str, list[int]]) -> None:
        """Tree integrity, plus: each node's direct lock count equals the requests locking it,
        locked nodes are still in the tree, and no block table references an unlocked node's
        block (so evicting it could never pull KV from under a running request)."""
        self.tree.check_integrity()
        expected = Counter(id(node) for node in self._locked.values())
        for rid, node in self._locked.items():
            assert node is self.tree.root or node.parent is not None, \
                f"request {rid!r} locks an evicted node"
            assert rid in block_tables, f"request {rid!r} holds a lock but no block table"
        in_tables = {b for table in block_tables.values() for b in table}
        for node in self.tree.nodes():
            direct = node.lock_ref - sum(c.lock_ref for c in node.children.values())
            assert direct == expected.get(id(node), 0), \
                f"{node!r}: {direct} direct locks but {expected.get(id(node), 0)} requests lock it"
            if node.lock_ref == 0:
                shared = in_tables.intersection(node.block_ids)
                assert not shared, f"unlocked {node!r} has blocks {sorted(shared)} in block tables"
