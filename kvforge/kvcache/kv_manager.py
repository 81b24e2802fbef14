"""Per-request block tables on top of the BlockPool.

A request's block table maps its token positions to physical blocks (B = block_size):

    positions:    0 1 2 3 | 4 5 6 7 | 8 9
    block_table: [   b5   ,   b2    ,  b9 ]        len == ceil(num_tokens_with_kv / B)
    token at pos p -> block block_table[p // B], offset p % B

After ``fork`` parent and child share every block (ref_cnt 2). The first write into a shared
block copies it first (copy-on-write):

    parent: [b5, b2]   child: [b5, b2]      prompt = 6 tokens, b2 half full, ref_cnt(b2) == 2
    child decodes pos 6 -> lands in b2 (shared) -> new block b7, copy (b2 -> b7)
    parent: [b5, b2]   child: [b5, b7]      ref_cnt(b2) == 1, ref_cnt(b7) == 1

With an attention window (``attention/window.py``: S sinks, W window) blocks that no future
query can see are released as the request moves on; their table entries become ``NULL_BLOCK``
so that ``block_table[p // B]`` still indexes every live position (B = 4, S = 2, W = 6):

    next position 14, window 9..14:   [b5, NULL, b9, b4]     b5: sinks 0-3 (never released)
                                       0-3  4-7   8-11 12-15  4-7: dead, b2 back in the pool
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvforge.attention.window import AttentionWindow
from kvforge.engine.request import Request
from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.prefix_cache import PrefixCache, PrefixCacheStats
from kvforge.kvcache.radix_tree import MatchResult


# table entry of a block released because it left the attention window
NULL_BLOCK = -1


class AllocatedSlots(NamedTuple):
    """What one ``allocate_slots`` call changed for its request."""

    new_block_ids: list[int]               # blocks appended or swapped in (copy destinations)
    block_copies: list[tuple[int, int]]    # (src, dst): copy src's KV into dst before the forward
    released_block_ids: list[int] = []     # left the attention window (table entries -> NULL_BLOCK)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """req_id -> block table; every reference count change goes through ``self.pool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: AttentionWindow | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if window is not None and enable_prefix_caching:
            raise ValueError("an attention window releases blocks a cached prefix would share: "
                             "turn prefix caching off")
        self.block_size = block_size
        # blocks out of every future query's window are released (None: all kept)
        self.window = window
        self.pool = BlockPool(num_blocks)
        # Most new tokens per allocation so that a request alone always fits (the scheduler
        # caps chunks at it): with a window, the largest n with max_live_blocks(B, n) <=
        # num_blocks, i.e. sink_blocks + ceil((B - 1 + W - 1 + n) / B) <= num_blocks. Unlimited
        # without one (a sequence must fit whole), or when not even a decode's blocks fit.
        self.max_chunk_tokens = sys.maxsize
        if window is not None:
            fit = ((num_blocks - window.num_sink_blocks(block_size)) * block_size
                   - (block_size - 1) - (window.window - 1))
            self.max_chunk_tokens = fit if fit >= 1 else sys.maxsize
        self._block_tables: dict[str, list[int]] = {}
        # radix-tree prefix cache (kvcache/prefix_cache.py); it holds one ref per cached block
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free capacity: blocks in the pool's free queue plus cached blocks no request uses
        (the prefix cache evicts those on demand). All blocks when no request runs."""
        evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.pool.num_free_blocks + evictable

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.prefix_cache.stats if self.prefix_cache else None

    @property
    def usage(self) -> float:
        """Fraction of blocks that requests reference: running ones, swapped ones whose KV is
        coming back or still being copied out. Blocks only the prefix cache holds are left out
        (they are reusable capacity, see ``num_free_blocks``), so it is 0 when nothing runs."""
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds none)."""
        return list(self._block_tables.get(request_id, ()))

    def has_blocks(self, request_id: str) -> bool:
        return bool(self._block_tables.get(request_id))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request references (its table minus released entries)."""
        return sum(b != NULL_BLOCK for b in self._block_tables.get(request_id, ()))

    def max_tokens_per_request(self, chunked: bool = True) -> int:
        """Longest sequence one request can grow to alone: the whole pool, or unbounded with a
        window when (``chunked``) its chunks are capped at ``max_chunk_tokens``."""
        if self.max_chunk_tokens < sys.maxsize and chunked:
            return sys.maxsize
        return self.num_blocks * self.block_size

    def request_ids(self) -> list[str]:
        return list(self._block_tables)

    def next_step_reserve(self, running: Sequence[Request]) -> int:
        """Blocks the running requests may take at their next step (a decode: its next block,
        counted whole): what admitting more work early must leave free."""
        return sum(cdiv(r.num_remaining_tokens + 1, self.block_size) for r in running)

    # ---- changes -------------------------------------------------------------------------
    def match_prefix(self, request: Request) -> MatchResult | None:
        """Longest cached prefix for a request about to be admitted (holding no blocks); None
        with the cache off or when the request needs prompt logprobs (they need every row)."""
        if self.prefix_cache is None or request.sampling_params.prompt_logprobs is not None:
            return None
        return self.prefix_cache.match(request.all_token_ids)

    def prefix_match_length(self, request: Request) -> int:
        """Tokens ``match_prefix`` would give, changing nothing (0 with the cache off)."""
        if self.prefix_cache is None or request.sampling_params.prompt_logprobs is not None:
            return 0
        return self.prefix_cache.match_length(request.all_token_ids)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: MatchResult | None = None) -> AllocatedSlots | None:
        """Make blocks exist, writable by this request, for positions
        [0, num_computed_tokens + num_new_tokens). None if the pool is short (nothing changed).

        ``prefix`` (from ``match_prefix``, for a request holding no blocks) makes the matched
        blocks the head of its table and the request's computed tokens start at
        ``prefix.num_tokens``; the caller sets ``num_computed_tokens`` to that on success.
        Cached blocks no request uses are evicted when the free queue alone is too short.
        With a window, blocks no query from ``num_computed_tokens`` on can see are released
        first (also when the call then returns None: they are dead either way).
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        request_id = request.request_id
        table = self._block_tables.get(request_id, [])
        first_pos = request.num_computed_tokens
        if prefix is not None:
            if table or self.prefix_cache is None:
                raise ValueError(f"a prefix match is only for admitting {request_id!r} with the "
                                 f"prefix cache on and no blocks held")
            self.prefix_cache.acquire(request_id, prefix)     # pins the blocks against eviction
            self.pool.incref(prefix.block_ids)
            table = list(prefix.block_ids)
            first_pos = prefix.num_tokens
        released = (self._release_out_of_window(table, first_pos)
                    if self.window is not None and num_new_tokens > 0 else [])
        end_pos = first_pos + num_new_tokens
        num_needed = cdiv(end_pos, self.block_size)
        num_missing = max(0, num_needed - len(table))
        # blocks this step writes into that already exist and are shared -> copy-on-write
        first_idx = first_pos // self.block_size
        shared_idx = [i for i in range(first_idx, min(len(table), num_needed))
                      if num_new_tokens > 0 and self.pool.ref_cnt(table[i]) > 1]

        new_block_ids = self._allocate(num_missing + len(shared_idx))
        if new_block_ids is None:
            if prefix is not None:                            # undo the acquire
                self.prefix_cache.release(request_id)
                self.pool.free(prefix.block_ids)
            return None
        if prefix is not None:
            self.prefix_cache.record_query(request.num_tokens, prefix.num_tokens)
        copies: list[tuple[int, int]] = []
        for i, dst in zip(shared_idx, new_block_ids):
            src = table[i]
            table[i] = dst
            # only a block holding already-computed tokens has content worth copying
            if i * self.block_size < first_pos:
                copies.append((src, dst))
            self.pool.free([src])        # our reference moves to dst; src stays with its sharers
        table.extend(new_block_ids[len(shared_idx):])
        if table:
            self._block_tables[request_id] = table
        return AllocatedSlots(new_block_ids, copies, released)

    def _release_out_of_window(self, table: list[int], next_pos: int) -> list[int]:
        """Release the table's blocks dead for queries at ``next_pos`` and later. Released
        entries form one run from the first non-sink block, so scanning down from the top of
        the dead range stops at the first entry released before: O(newly dead blocks)."""
        dead = self.window.dead_blocks(next_pos, self.block_size)
        released = []
        for i in reversed(range(dead.start, min(dead.stop, len(table)))):
            if table[i] == NULL_BLOCK:
                break
            released.append(table[i])
            table[i] = NULL_BLOCK
        released.reverse()                                    # table order
        self.pool.free(released)
        return released

    def _allocate(self, num_blocks: int) -> list[int] | None:
        short = num_blocks - self.pool.num_free_blocks
        if short > 0 and self.prefix_cache is not None:
            if short > self.prefix_cache.num_evictable_blocks:
                return None                                   # evict nothing in vain
            self.prefix_cache.evict(short)
        return self.pool.allocate(num_blocks)

    def cache_computed_blocks(self, request: Request) -> None:
        """Offer the request's full computed blocks to the prefix cache (no-op when off)."""
        table = self._block_tables.get(request.request_id)
        if self.prefix_cache is not None and table:
            self.prefix_cache.cache(request.request_id, request.all_token_ids, table,
                                    request.num_computed_tokens)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks wholly past the first ``num_tokens`` positions (speculative
        decoding's rejected lookahead slots); the block holding position num_tokens - 1 stays.

            num_tokens = 6, B = 4:  [b3: 0-3][b8: 4 5 x x][b1: x x x x]  ->  b1 freed
        """
        table = self._block_tables.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if table and len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(reversed(extra))

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks (each gains one reference)."""
        if parent_id not in self._block_tables:
            raise ValueError(f"cannot fork from {parent_id!r}: it holds no blocks")
        if child_id in self._block_tables:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        table = list(self._block_tables[parent_id])
        self.pool.incref(b for b in table if b != NULL_BLOCK)
        self._block_tables[child_id] = table
        if self.prefix_cache is not None:
            self.prefix_cache.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        """Drop all the request's references; unknown ids are ignored (idempotent).

        Blocks go back in reverse table order: the tail of a sequence is the least likely to be
        a shared prefix, so it should be evicted first once a prefix cache revives free blocks.
        """
        table = self._block_tables.pop(request_id, None)
        if self.prefix_cache is not None:
            self.prefix_cache.release(request_id)
        if table:
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)

    def check_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Window invariant of a running request: every block a query from
        ``num_computed_tokens`` on can see is held (released entries only in the dead range)."""
        if self.window is None:
            return
        dead = self.window.dead_blocks(num_computed_tokens, self.block_size)
        for i, block in enumerate(self._block_tables.get(request_id, ())):
            assert block != NULL_BLOCK or i in dead, (
                f"{request_id!r}: block {i} released but visible from position "
                f"{num_computed_tokens} ({self.window})")

    def check_integrity(self, extra_refs: Mapping[int, int] | None = None) -> None:
        """Pool integrity, plus: table references (+ ``extra_refs``, e.g. held by a prefix cache)
        to each block equal its ref_cnt."""
        self.pool.check_integrity()
        refs = Counter(b for table in self._block_tables.values() for b in table
                       if b != NULL_BLOCK)
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity(self._block_tables)
            refs.update(self.prefix_cache.block_refs())
        for block_id, count in (extra_refs or {}).items():
            refs[block_id] += count
        for table_owner, table in self._block_tables.items():
            assert table, f"{table_owner!r} has an empty block table entry"
            if self.window is None:
                assert NULL_BLOCK not in table, f"{table_owner!r} released a block without a window"
            else:
                sinks = self.window.num_sink_blocks(self.block_size)
                assert NULL_BLOCK not in table[:sinks], f"{table_owner!r} released a sink block"
        for block in self.pool.blocks:
            assert refs[block.block_id] == block.ref_cnt, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} "
                f"references from block tables")
