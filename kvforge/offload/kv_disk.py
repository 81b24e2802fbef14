"""The KV cache's disk tier: a layer whose KV the policy places on disk keeps its blocks in a
file of slots (``kv_slots.DiskSlotMap`` says which slot holds which block; all disk-KV layers
share it), each slot a block's K then its V. Block ids, block tables, prefix sharing and
copy-on-write mean what they mean in RAM; only the file offsets move.

A batch reads the slots of the blocks its tables name into a staging buffer laid out as the
RAM pool ``[2, num_local, B, H, D]``: contiguous slots (and small gaps, read through) become one
vectored direct read each (K and V of a slot land in their planes), and the batch's metadata is
rewritten to the staging buffer's local ids. After the layer runs, the blocks that received new
tokens are written, with one vectored write per run, to the fresh slots the step reserved for
them (a small direct write costs its latency, ~60 us here, more than its bytes)."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from kvforge.offload.direct_io import ALIGN, AlignedBuffer, open_direct, transfer

MAX_GAP_BLOCKS = 2        # read through gaps this short instead of issuing another read


@dataclass
class BlockReadPlan:
    """The disk slots of one batch's blocks mapped onto a staging buffer: ``runs`` of
    (first slot, count, first local id); ``local_of`` slot -> local id (gaps read through
    included: other blocks' or free slots, never written from here)."""
    runs: list[tuple[int, int, int]]
    num_local: int
    local_of: dict[int, int] = field(default_factory=dict)


def plan_block_reads(slots: list[int], max_gap: int = MAX_GAP_BLOCKS) -> BlockReadPlan:
    ids = sorted(set(slots))
    runs: list[tuple[int, int, int]] = []
    local = 0
    for b in ids:
        if runs and b - (runs[-1][0] + runs[-1][1]) <= max_gap:
            first, count, l0 = runs[-1]
            grown = b - first + 1
            local += grown - count
            runs[-1] = (first, grown, l0)
        else:
            runs.append((b, 1, local))
            local += 1
    local_of = {}
    for first, count, l0 in runs:
        for i in range(count):
            local_of[first + i] = l0 + i
    return BlockReadPlan(runs, local, local_of)


class DiskKVLayer:
    def __init__(self, path: str, num_slots: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.path = path
        self.num_slots = num_slots
        self.block_shape = tuple(block_shape)          # (B, H, D)
        self.dtype = dtype
        n = 1
        for s in block_shape:
            n *= s
        self.block_bytes = n * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = 2 * self.block_bytes         # K, then V
        with open(path, "wb") as f:                    # sparse: costs disk only when written
            f.truncate(num_slots * self.slot_bytes)
        self.fd, self.direct = open_direct(path, writable=True)
        if self.block_bytes % ALIGN:
            # unaligned blocks cannot be read directly: buffered I/O + page-cache eviction
            os.close(self.fd)
            self.fd, self.direct = os.open(path, os.O_RDWR), False
        # the open descriptor keeps the file; its name goes now, so the disk space returns
        # when the process ends however it ends (an engine never shut down, a kill)
        os.unlink(path)
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()     # reads run on several loader threads

    def staging_bytes(self, plan: BlockReadPlan) -> int:
        return 2 * plan.num_local * self.block_bytes

    def staging_view(self, buf: torch.Tensor, plan: BlockReadPlan) -> torch.Tensor:
        n = plan.num_local * self.block_bytes
        return buf[:2 * n].view(self.dtype).view(2, plan.num_local, *self.block_shape)

    def _planes(self, buf: memoryview, num_local: int, locals_: list[int]) -> list[memoryview]:
        """The staged K and V of each local block, in file order (slot by slot)."""
        bb, half = self.block_bytes, num_local * self.block_bytes
        out = []
        for l in locals_:
            out.append(buf[l * bb:(l + 1) * bb])
            out.append(buf[half + l * bb:half + (l + 1) * bb])
        return out

    def read(self, plan: BlockReadPlan, buf: memoryview) -> None:
        """Stage the plan's runs of slots (``runs`` of (first slot, count, first local id))."""
        for first, count, l0 in plan.runs:
            views = self._planes(buf, plan.num_local, list(range(l0, l0 + count)))
            self._io(os.preadv, views, first * self.slot_bytes)
            with self._count_lock:
                self.bytes_read += count * self.slot_bytes

    def write(self, num_local: int, runs: list[tuple[int, list[int]]], buf: memoryview) -> None:
        """Write staged blocks to fresh slots: ``runs`` of (first slot, local ids), one
        vectored write per run."""
        for first, locals_ in runs:
            self._io(os.pwritev, self._planes(buf, num_local, locals_), first * self.slot_bytes)
            self.bytes_written += len(locals_) * self.slot_bytes

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of whole blocks (K and V), slot to slot."""
        tmp = AlignedBuffer(self.slot_bytes)
        view = tmp.view[:self.slot_bytes]
        for src, dst in copies:
            self._io(os.preadv, [view], src * self.slot_bytes)
            self._io(os.pwritev, [view], dst * self.slot_bytes)

    def _io(self, op, views: list[memoryview], offset: int) -> None:
        transfer(op, self.fd, views, offset, self.path, self.direct)

    def close(self) -> None:
        os.close(self.fd)
