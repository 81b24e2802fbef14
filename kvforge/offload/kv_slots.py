"""Where each KV block of the disk tier lives in the layer files: a slot per block, shared by
every disk-KV layer (each layer's step writes the same blocks, so one table serves them all).

Why slots and not the block id as the file offset: a decode step adds one token to every
sequence, i.e. rewrites one block per sequence (its current block). At the block id's own
place those blocks lie between the sequences' full blocks, so writing them back costs either
one small write per sequence (a direct write costs its latency, ~60 us here, not its 12 KiB)
or one write through all the full blocks between them (three times the bytes on a 33-token
prompt). Instead a step's written blocks move to fresh slots taken in one contiguous run, in
the step's batch order: each batch writes its blocks with one vectored write of only those
blocks, and reads its full blocks (one run) and its current ones (one run) back.

    slots    [ 0 .. num_blocks )                 [ num_blocks .. 2 * num_blocks )
    file     |K V|K V|K V| ... one slot = a block's K and V, side by side ...     |
    step     reserve(written) -> the lowest free runs; commit() after the step's writes:
             the blocks point at them and their old slots are free again;
             rollback() on a failed step: the blocks keep their old (intact) slots

The old slots stay untouched until commit because later layers of the same step still read
them (a layer reads its pre-step KV, then writes its new blocks to the fresh run)."""
from __future__ import annotations


class DiskSlotMap:
    def __init__(self, num_blocks: int, capacity: int | None = None) -> None:
        capacity = 2 * num_blocks if capacity is None else capacity
        if num_blocks < 1 or capacity < num_blocks:
            raise ValueError(f"slot map needs 1 <= num_blocks <= capacity, got num_blocks="
                             f"{num_blocks}, capacity={capacity}")
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.slot_of = list(range(num_blocks))          # block id -> slot (a block's first home)
        self._free = bytearray(capacity)
        for s in range(num_blocks, capacity):
            self._free[s] = 1
        self._pending: dict[int, int] = {}              # block -> reserved slot (this step)

    @property
    def num_free(self) -> int:
        return sum(self._free)

    def reserve(self, blocks: list[int]) -> list[tuple[int, list[int]]]:
        """Fresh slots for ``blocks`` (in the order given, repeats once) as (first slot,
        blocks) runs, as few as the free space allows: one unless it is fragmented. A block
        has one writer a step (a shared block is copied before it is written), so a block
        already reserved this step is an error."""
        todo = list(dict.fromkeys(blocks))
        again = [b for b in todo if b in self._pending]
        if again:
            raise ValueError(f"blocks {again} already reserved this step")
        runs: list[tuple[int, list[int]]] = []
        i = 0
        while i < len(todo):
            first, count = self._take_run(len(todo) - i)
            for k in range(count):
                self._pending[todo[i + k]] = first + k
            runs.append((first, todo[i:i + count]))
            i += count
        return runs

    def slot_reserved(self, block: int) -> int:
        return self._pending[block]

    def commit(self) -> None:
        """The step's writes are on disk: reserved slots become the blocks' homes."""
        for block, slot in self._pending.items():
            self._free[self.slot_of[block]] = 1
            self.slot_of[block] = slot
        self._pending.clear()

    def rollback(self) -> None:
        """A step failed before its writes all landed: give its reserved slots back."""
        for slot in self._pending.values():
            self._free[slot] = 1
        self._pending.clear()

    def _take_run(self, want: int) -> tuple[int, int]:
        """The lowest free run of ``want`` slots, else the longest free run there is. Lowest
        first: the slots a step frees are the next step's run, so writes keep landing on file
        space already allocated instead of extending a sparse file (a direct write into a hole
        makes the filesystem allocate, 3-4x the time of a rewrite here)."""
        first = self._free.find(b"\x01" * want)
        count = want
        if first < 0:
            first, count, s = 0, 0, 0
            while s < self.capacity:
                start = self._free.find(b"\x01", s)
                if start < 0:
                    break
                end = self._free.find(b"\x00", start)
                end = self.capacity if end < 0 else end
                if end - start > count:
                    first, count = start, end - start
                s = end
        if count == 0:
            raise RuntimeError(f"disk KV slot map full: {len(self._pending)} blocks reserved "
                               f"this step, capacity {self.capacity}")
        self._free[first:first + count] = b"\x00" * count
        return first, count

    def check_integrity(self) -> None:
        """Every block has one slot of its own, no slot is both free and in use, and the
        step's reservations are distinct free-marked-taken slots."""
        homes = self.slot_of
        if len(homes) != self.num_blocks:
            raise AssertionError(f"{len(homes)} homes for {self.num_blocks} blocks")
        if len(set(homes)) != len(homes):
            raise AssertionError("two blocks share a disk slot")
        reserved = list(self._pending.values())
        if len(set(reserved)) != len(reserved) or set(reserved) & set(homes):
            raise AssertionError("a reserved slot is reserved twice or still a block's home")
        used = set(homes) | set(reserved)
        for s in range(self.capacity):
            if (s in used) == bool(self._free[s]):
                raise AssertionError(f"slot {s} is {'free' if self._free[s] else 'taken'} "
                                     f"but {'in use' if s in used else 'unused'}")
