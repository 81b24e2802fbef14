"""Physical KV blocks with reference counts and an LRU free queue.

A block is free exactly when its ``ref_cnt`` is 0; free blocks sit in a doubly-linked queue
threaded through the block objects themselves, so that

    popleft (allocate the least recently freed)   O(1)
    append  (a block's last reference dropped)    O(1)
    remove  (revive a free block from the middle,
             e.g. a prefix-cache hit)              O(1)

    head sentinel <-> b3 <-> b0 <-> b7 <-> tail sentinel
                      ^ evicted / reused first    ^ freed most recently

Freed blocks keep their contents until reused, which is what lets a prefix cache revive them.

A block's references come from two kinds of holder, and the pool counts them apart:

    ref_cnt = request references (block tables, in-flight swap copies) + cached (0 or 1)

``num_used_blocks`` counts blocks with a request reference: the KV that running (or swapped-in)
requests need now. A block that only the prefix cache holds is reusable on demand, so it is not
"used" (an idle server with a warm cache reads 0 usage), nor is it free (it is not in the queue).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class KVBlock:
    """One physical KV block; ``prev_free``/``next_free`` are set only while it is free;
    ``cached`` while one of its references is the prefix cache's."""

    __slots__ = ("block_id", "ref_cnt", "cached", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cached = False
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    @property
    def num_request_refs(self) -> int:
        return self.ref_cnt - self.cached

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.cached})"


class FreeBlockQueue:
    """Doubly-linked queue of free blocks between two sentinels (no None checks at the ends)."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self.head = KVBlock(-1)   # sentinel: head.next_free is the oldest free block
        self.tail = KVBlock(-1)   # sentinel: tail.prev_free is the newest free block
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        node = self.head.next_free
        while node is not self.tail:
            yield node
            node = node.next_free

    @staticmethod
    def contains(block: KVBlock) -> bool:
        return block.next_free is not None

    def append(self, block: KVBlock) -> None:
        if self.contains(block):
            raise RuntimeError(f"{block} is already in the free queue")
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVBlock) -> None:
        if not self.contains(block):
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVBlock:
        if self.num_free_blocks == 0:
            raise RuntimeError("popleft from an empty free queue")
        block = self.head.next_free
        self.remove(block)
        return block


class BlockPool:
    """``num_blocks`` KV blocks; callers hold block ids and the pool keeps the reference counts.

    All reference counting goes through ``allocate`` / ``incref`` / ``free`` so that a block is
    free exactly when ``ref_cnt == 0``; the prefix cache passes ``by_cache=True`` for its one
    reference per cached block, so that ``num_used_blocks`` can leave cache-only blocks out.
    ``on_block_reused(block_id)`` is called when a free block is handed out again: a prefix
    cache hooks it to forget the block's old contents.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.num_used_blocks = 0            # blocks with at least one request reference
        self.num_cached_blocks = 0          # blocks holding the prefix cache's reference
        self.on_block_reused: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks that requests reference, in [0, 1] (cache-only blocks excluded:
        0 whenever no request holds KV, however full the prefix cache)."""
        return self.num_used_blocks / self.num_blocks

    def _block(self, block_id: int) -> KVBlock:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} out of range [0, {self.num_blocks})")
        return self.blocks[block_id]

    def ref_cnt(self, block_id: int) -> int:
        return self._block(block_id).ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order (next to be allocated first)."""
        return [b.block_id for b in self.free_queue]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the free-queue head with ref_cnt 1; None (and nothing
        taken) when fewer are free."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"number of blocks to allocate must be >= 0, got {num_blocks!r}")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            block.ref_cnt = 1
            self.num_used_blocks += 1
            if self.on_block_reused is not None:
                self.on_block_reused(block.block_id)
            block_ids.append(block.block_id)
        return block_ids

    def incref(self, block_ids: Iterable[int], *, by_cache: bool = False) -> None:
        """Add one reference to each block; a free block is revived (taken out of the queue)
        with its contents intact. ``by_cache``: the reference is the prefix cache's (at most
        one per block)."""
        for block_id in block_ids:
            block = self._block(block_id)
            if by_cache and block.cached:
                raise RuntimeError(f"{block} is already cached")
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            if by_cache:
                block.cached = True
                self.num_cached_blocks += 1
            elif block.num_request_refs == 0:
                self.num_used_blocks += 1
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int], *, by_cache: bool = False) -> None:
        """Drop one reference from each block (the prefix cache's with ``by_cache``); blocks
        reaching 0 join the free-queue tail in the order given (so the caller decides which are
        evicted first)."""
        for block_id in block_ids:
            block = self._block(block_id)
            if by_cache:
                if not block.cached:
                    raise RuntimeError(f"the prefix cache frees {block}, which it does not hold")
                block.cached = False
                self.num_cached_blocks -= 1
            else:
                if block.num_request_refs <= 0:
                    raise RuntimeError(f"double free of block {block_id} (ref_cnt "
                                       f"{block.ref_cnt}, cached {block.cached})")
                if block.num_request_refs == 1:
                    self.num_used_blocks -= 1
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free queue and the ref counts agree exactly."""
        queue = self.free_queue
        assert queue.head.prev_free is None and queue.tail.next_free is None, "sentinel has an outer link"
        # forward walk: back links consistent, no cycle, only real free blocks, each once
        forward: list[KVBlock] = []
        seen: set[int] = set()
        node = queue.head
        while node.next_free is not queue.tail:
            nxt = node.next_free
            assert nxt is not None, f"free queue broken after {node}"
            assert nxt.prev_free is node, f"{nxt}.prev_free is {nxt.prev_free}, expected {node}"
            assert 0 <= nxt.block_id < self.num_blocks and self.blocks[nxt.block_id] is nxt, \
                f"foreign block {nxt} in free queue"
            assert nxt.block_id not in seen, f"{nxt} appears twice in the free queue (cycle?)"
            assert nxt.ref_cnt == 0, f"{nxt} is in the free queue with ref_cnt {nxt.ref_cnt}"
            seen.add(nxt.block_id)
            forward.append(nxt)
            node = nxt
        assert queue.tail.prev_free is node, "tail sentinel does not point at the last free block"
        # backward walk must give the same sequence reversed
        backward: list[KVBlock] = []
        node = queue.tail.prev_free
        while node is not queue.head and len(backward) <= self.num_blocks:
            backward.append(node)
            node = node.prev_free
        assert backward[::-1] == forward, "free queue differs walked forward and backward"
        assert len(forward) == queue.num_free_blocks, \
            f"free queue holds {len(forward)} blocks but counts {queue.num_free_blocks}"
        for block in self.blocks:
            assert block.num_request_refs >= 0, f"{block} has a negative ref_cnt"
            if block.ref_cnt == 0:
                assert block.block_id in seen, f"{block} has ref_cnt 0 but is not in the free queue"
            else:
                assert block.prev_free is None and block.next_free is None, \
                    f"{block} is referenced but still linked into the free queue"
        used = sum(b.num_request_refs > 0 for b in self.blocks)
        assert used == self.num_used_blocks, \
            f"{used} blocks have request references but num_used_blocks is {self.num_used_blocks}"
        cached = sum(b.cached for b in self.blocks)
        assert cached == self.num_cached_blocks, \
            f"{cached} blocks are cached but num_cached_blocks is {self.num_cached_blocks}"
