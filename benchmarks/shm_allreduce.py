"""An all-reduce through shared memory for ranks on one machine: the benchmark's lower bound
of what a node-local collective costs, beside gloo's loopback sockets (vLLM's CPU backend sums
through shared memory the same way). Not used by the engine: its ranks wait by spinning, which
takes cores from the model on a busy machine.

One file in /dev/shm: a flag area, then one slot of ``max_bytes`` per rank.

    all_reduce(t), call number s:
      wait until every rank has read call s-1's slots     (read[r] >= s - 1)
      copy t into my slot; written[me] = s
      wait until every rank has written                   (written[r] >= s)
      t = slot 0 + slot 1 + ...   (the same order on every rank: the same bits)
      read[me] = s

x86 keeps stores in program order, so a flag seen set means the slot before it is written.
"""
from __future__ import annotations

import os
import time

import torch

_FLAG_STRIDE = 8          # int64s per flag: one 64-byte cache line each


class ShmAllReduce:
    def __init__(self, name: str, rank: int, world_size: int, max_bytes: int,
                 create: bool) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size, self.max_bytes = rank, world_size, max_bytes
        self.path = f"/dev/shm/{name}"
        flag_bytes = 2 * world_size * _FLAG_STRIDE * 8
        total = flag_bytes + world_size * max_bytes
        if create:
            with open(self.path, "wb") as f:
                f.truncate(total)
        buf = torch.from_file(self.path, shared=True, size=total, dtype=torch.uint8)
        flags = buf[:flag_bytes].view(torch.int64).view(2, world_size, _FLAG_STRIDE)
        self.written, self.read = flags[0, :, 0], flags[1, :, 0]
        self.slots = buf[flag_bytes:].view(world_size, max_bytes)
        self.calls = 0

    def _wait(self, flags: torch.Tensor, value: int) -> None:
        spins = 0
        while int(flags.min()) < value:
            spins += 1
            if spins % 64 == 0:
                time.sleep(0)                # let a peer sharing this core run

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (float32, contiguous, at most ``max_bytes``) over the ranks, in place."""
        nbytes = t.numel() * t.element_size()
        if t.dtype != torch.float32 or nbytes > self.max_bytes:
            raise ValueError(f"ShmAllReduce takes float32 tensors of at most {self.max_bytes} "
                             f"bytes, got {t.dtype} of {nbytes}")
        self.calls += 1
        s = self.calls
        self._wait(self.read, s - 1)
        self.slots[self.rank, :nbytes].view(torch.float32).copy_(t.reshape(-1))
        self.written[self.rank] = s
        self._wait(self.written, s)
        views = [self.slots[r, :nbytes].view(torch.float32) for r in range(self.world_size)]
        out = views[0].clone()
        for v in views[1:]:
            out += v
        self.read[self.rank] = s
        t.copy_(out.view_as(t))
        return t

    def close(self) -> None:
        if self.rank == 0 and os.path.exists(self.path):
            os.unlink(self.path)
