"""Radix tree over token ids whose nodes own KV blocks (RadixAttention-style prefix cache).

Nodes are BLOCK-granular: every edge holds a whole number of full blocks, and only full blocks
are ever cached. Why not token-granular nodes with copy-on-write of a partial last block?
  - the KV pool is paged in blocks; a block is the unit a block table can point at, so a
    token-granular hit still has to copy the partial block before use: extra copies and an extra
    allocation on the hot path, to save fewer than ``block_size`` tokens of prefill per request;
  - a full cached block is immutable (no request ever writes into it: writes land at positions
    >= num_computed_tokens, past every matched block), so sharing needs no copy-on-write at all;
  - children are keyed by their first block's tokens, so lookups hash B tokens at a time.
A prefix that ends mid-block is matched up to its last full block; the rest is recomputed.

    B = 4, cached: "a b c d|e f g h|i j k l" and "a b c d|e f g h|x y z w"

    root ── [a b c d|e f g h] blocks (3, 7) ─┬─ [i j k l] block (2)
                                             └─ [x y z w] block (9)

    match_prefix("a b c d e f g h i j k") -> 8 tokens, blocks [3, 7] ("i j k" is not a full block)
    insert("a b c d q r s t", [3, 5]) -> splits [a..h] at one block:

    root ── [a b c d] (3) ─┬─ [e f g h] (7) ─┬─ [i j k l] (2)
                           │                 └─ [x y z w] (9)
                           └─ [q r s t] (5)

Ownership: the tree holds ONE pool reference on every block it caches, so a cached block is
never in the pool's free queue. ``lock(node)`` pins a node and its ancestors (``lock_ref`` counts
lockers below and at the node); an unlocked node's blocks are "evictable": they count as free
capacity and ``evict`` returns them to the pool, least recently used leaf first, through a heap
with lazy deletion (stale entries are skipped when popped), never a whole-tree walk.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from kvforge.kvcache.block_pool import BlockPool


class RadixNode:
    """One edge of the tree: ``token_ids`` (a multiple of B) and the blocks holding their KV."""

    __slots__ = ("parent", "children", "token_ids", "block_ids", "lock_ref", "last_access")

    def __init__(self, parent: RadixNode | None, token_ids: tuple[int, ...],
                 block_ids: list[int], last_access: int) -> None:
        self.parent = parent              # None for the root and for evicted nodes
        self.children: dict[tuple[int, ...], RadixNode] = {}   # key: child's first block tokens
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.lock_ref = 0                 # lockers of this node or of any descendant
        self.last_access = last_access    # logical clock; larger = more recently used

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"RadixNode(tokens={len(self.token_ids)}, blocks={self.block_ids}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)})")


class MatchResult(NamedTuple):
    """Longest cached prefix. ``node`` is the deepest matched node (the root when nothing
    matched); lock it before using ``block_ids`` so they cannot be evicted."""

    num_tokens: int
    block_ids: list[int]
    node: RadixNode


class InsertResult(NamedTuple):
    """``num_cached_tokens``: how many of the inserted tokens were already cached (their blocks
    stay the tree's; the caller's duplicates are not taken). ``node`` ends exactly at the
    inserted tokens: lock it to pin everything inserted."""

    num_cached_tokens: int
    node: RadixNode


class RadixTree:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.pool = pool
        self.block_size = block_size
        self._clock = itertools.count(1)
        self.root = RadixNode(None, (), [], 0)
        self.num_nodes = 0                  # excluding the root
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0       # blocks in unlocked nodes
        # (last_access, tiebreak, node) for unlocked leaves; stale entries are skipped on pop
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._tiebreak = itertools.count()

    # ---- lookup --------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole blocks. Splits the last matched node
        so that the returned node ends exactly at the match, and marks the path used now."""
        node, num_tokens, blocks = self._walk(token_ids, split=True)
        self._touch(node)
        return MatchResult(num_tokens, blocks, node)

    def match_length(self, token_ids: Sequence[int]) -> int:
        """Tokens ``match_prefix`` would return, without changing anything (for schedulers)."""
        return self._walk(token_ids, split=False)[1]

    def _walk(self, token_ids: Sequence[int], split: bool) -> tuple[RadixNode, int, list[int]]:
        B = self.block_size
        usable = len(token_ids) // B * B
        node, pos, blocks = self.root, 0, []
        while pos < usable:
            child = node.children.get(tuple(token_ids[pos:pos + B]))
            if child is None:
                break
            k = self._num_matching_blocks(child, token_ids, pos, usable)
            if k < child.num_blocks:
                if not split:
                    return node, pos + k * B, blocks + child.block_ids[:k]
                child = self._split(child, k)
            blocks.extend(child.block_ids)
            pos += child.num_blocks * B
            node = child
        return node, pos, blocks

    def _num_matching_blocks(self, node: RadixNode, token_ids: Sequence[int], pos: int,
                             usable: int) -> int:
        """Whole blocks of ``node`` equal to token_ids[pos:usable] (>= 1: the key matched)."""
        B = self.block_size
        k = 1
        while (k < node.num_blocks and pos + (k + 1) * B <= usable
               and tuple(token_ids[pos + k * B: pos + (k + 1) * B])
               == node.token_ids[k * B:(k + 1) * B]):
            k += 1
        return k

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``node`` after ``num_blocks`` blocks; return the new upper part.

            parent ── [t0..tk | tk..tn] node    ->   parent ── [t0..tk] upper ── [tk..tn] node
        """
        B = self.block_size
        assert 0 < num_blocks < node.num_blocks
        parent = node.parent
        upper = RadixNode(parent, node.token_ids[:num_blocks * B], node.block_ids[:num_blocks],
                          node.last_access)
        upper.lock_ref = node.lock_ref           # same lockers: they all pass through upper
        node.token_ids = node.token_ids[num_blocks * B:]
        node.block_ids = node.block_ids[num_blocks:]
        node.parent = upper
        upper.children[node.token_ids[:B]] = node
        parent.children[upper.token_ids[:B]] = upper
        self.num_nodes += 1
        return upper

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> InsertResult:
        """Cache ``block_ids`` as the KV of ``token_ids`` (exactly ``len(block_ids)`` full blocks).

        The part already cached keeps the tree's blocks; the rest becomes one new leaf whose
        blocks gain one (the tree's) reference each.
        """
        B = self.block_size
        if len(token_ids) != len(block_ids) * B:
            raise ValueError(f"insert needs {len(block_ids)} x {B} tokens for {len(block_ids)} "
                             f"blocks, got {len(token_ids)} tokens")
        node, pos, _ = self._walk(token_ids, split=True)
        if pos < len(token_ids):
            new_blocks = list(block_ids[pos // B:])
            self.pool.incref(new_blocks, by_cache=True)
            leaf = RadixNode(node, tuple(token_ids[pos:]), new_blocks, 0)
            node.children[leaf.token_ids[:B]] = leaf
            self.num_nodes += 1
            self.num_cached_blocks += len(new_blocks)
            self.num_evictable_blocks += len(new_blocks)      # unlocked until someone locks it
            node = leaf
        self._touch(node)
        return InsertResult(pos, node)

    def _touch(self, node: RadixNode) -> None:
        now = next(self._clock)
        leaf = node
        while node is not self.root:
            node.last_access = now
            node = node.parent
        self._push_if_evictable(leaf)

    # ---- locking -------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors (their blocks stop being evictable)."""
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"cannot lock {node!r}: it was evicted")
            if node.lock_ref == 0:
                self.num_evictable_blocks -= node.num_blocks
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of {node!r} which is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_blocks += node.num_blocks
                self._push_if_evictable(node)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Return at least ``num_blocks`` blocks to the pool (fewer only if fewer are evictable),
        taking whole unlocked leaves, least recently used first. Returns the evicted block ids
        in eviction order."""
        evicted: list[int] = []
        while len(evicted) < num_blocks and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.last_access != last_access:
                continue                                       # stale heap entry
            parent = node.parent
            del parent.children[node.token_ids[:self.block_size]]
            node.parent = None
            self.num_nodes -= 1
            self.num_cached_blocks -= node.num_blocks
            self.num_evictable_blocks -= node.num_blocks
            # tail first: within one leaf the last block is the least shareable
            self.pool.free(reversed(node.block_ids), by_cache=True)
            evicted.extend(reversed(node.block_ids))
            self._push_if_evictable(parent)
        if len(self._heap) > 2 * self.num_nodes + 64:
            self._rebuild_heap()
        return evicted

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return (node is not self.root and node.parent is not None and node.is_leaf
                and node.lock_ref == 0)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, next(self._tiebreak), n) for n in self.nodes()
                      if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

    # ---- inspection ----------------------------------------------------------------------
    def nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def block_refs(self) -> Counter:
        """block id -> 1 for every cached block: the tree's references (``extra_refs``)."""
        return Counter(b for node in self.nodes() for b in node.block_ids)

    def direct_locks(self) -> dict[int, int]:
        """id(node) -> lockers that locked exactly this node (lock_ref minus the children's)."""
        return {id(n): n.lock_ref - sum(c.lock_ref for c in n.children.values())
                for n in self.nodes()}

    def check_integrity(self) -> None:
        """Structure, counts, lock arithmetic, heap coverage and pool references all agree."""
        B = self.block_size
        assert self.root.parent is None and not self.root.token_ids and not self.root.block_ids
        seen_blocks: set[int] = set()
        num_nodes = num_blocks = num_evictable = 0
        heap_entries = {(id(n), t) for t, _, n in self._heap}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node, f"{child!r} has the wrong parent"
                assert child.token_ids[:B] == key, f"{child!r} filed under the wrong key"
                assert child.num_blocks > 0 and len(child.token_ids) == child.num_blocks * B, \
                    f"{child!r} does not hold whole blocks"
                stack.append(child)
            if node is self.root:
                continue
            num_nodes += 1
            num_blocks += node.num_blocks
            children_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= children_locks, \
                f"{node!r} has fewer locks than its children ({children_locks})"
            if node.lock_ref == 0:
                num_evictable += node.num_blocks
            if node.is_leaf and node.lock_ref == 0:
                assert (id(node), node.last_access) in heap_entries, \
                    f"evictable leaf {node!r} is missing from the eviction heap"
            for block_id in node.block_ids:
                assert block_id not in seen_blocks, f"block {block_id} cached twice"
                seen_blocks.add(block_id)
                assert self.pool.ref_cnt(block_id) >= 1, \
                    f"cached block {block_id} has ref_cnt 0 (it is in the free queue)"
                assert self.pool.blocks[block_id].cached, \
                    f"cached block {block_id} does not hold the cache's reference in the pool"
        assert num_nodes == self.num_nodes, f"{num_nodes} nodes, counted {self.num_nodes}"
        assert num_blocks == self.num_cached_blocks == self.pool.num_cached_blocks, \
            f"{num_blocks} cached blocks, counted {self.num_cached_blocks} (pool: " \
            f"{self.pool.num_cached_blocks})"
        assert num_evictable == self.num_evictable_blocks, \
            f"{num_evictable} evictable blocks, counted {self.num_evictable_blocks}"
