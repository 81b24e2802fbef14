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
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

from kvforge.engine.request import Request
from kvforge.kvcache.block_pool import BlockPool


class AllocatedSlots(NamedTuple):
    """What one ``allocate_slots`` call changed for its request."""

    new_block_ids: list[int]               # blocks appended or swapped in (copy destinations)
    block_copies: list[tuple[int, int]]    # (src, dst): copy src's KV into dst before the forward


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """req_id -> block table; every reference count change goes through ``self.pool``."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds none)."""
        return list(self._block_tables.get(request_id, ()))

    def has_blocks(self, request_id: str) -> bool:
        return bool(self._block_tables.get(request_id))

    def request_ids(self) -> list[str]:
        return list(self._block_tables)

    # ---- changes -------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> AllocatedSlots | None:
        """Make blocks exist, writable by this request, for positions
        [0, num_computed_tokens + num_new_tokens). None if the pool is short (nothing changed).
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        request_id = request.request_id
        table = self._block_tables.get(request_id, [])
        first_pos = request.num_computed_tokens
        end_pos = first_pos + num_new_tokens
        num_needed = cdiv(end_pos, self.block_size)
        num_missing = max(0, num_needed - len(table))
        # blocks this step writes into that already exist and are shared -> copy-on-write
        first_idx = first_pos // self.block_size
        shared_idx = [i for i in range(first_idx, min(len(table), num_needed))
                      if num_new_tokens > 0 and self.pool.ref_cnt(table[i]) > 1]

        new_block_ids = self.pool.allocate(num_missing + len(shared_idx))
        if new_block_ids is None:
            return None
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
        return AllocatedSlots(new_block_ids, copies)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks (each gains one reference)."""
        if parent_id not in self._block_tables:
            raise ValueError(f"cannot fork from {parent_id!r}: it holds no blocks")
        if child_id in self._block_tables:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        table = list(self._block_tables[parent_id])
        self.pool.incref(table)
        self._block_tables[child_id] = table

    def free(self, request_id: str) -> None:
        """Drop all the request's references; unknown ids are ignored (idempotent).

        Blocks go back in reverse table order: the tail of a sequence is the least likely to be
        a shared prefix, so it should be evicted first once a prefix cache revives free blocks.
        """
        table = self._block_tables.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def check_integrity(self, extra_refs: Mapping[int, int] | None = None) -> None:
        """Pool integrity, plus: table references (+ ``extra_refs``, e.g. held by a prefix cache)
        to each block equal its ref_cnt."""
        self.pool.check_integrity()
        refs = Counter(b for table in self._block_tables.values() for b in table)
        for block_id, count in (extra_refs or {}).items():
            refs[block_id] += count
        for table_owner, table in self._block_tables.items():
            assert table, f"{table_owner!r} has an empty block table entry"
        for block in self.pool.blocks:
            assert refs[block.block_id] == block.ref_cnt, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} "
                f"references from block tables")
