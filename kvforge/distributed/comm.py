"""A process group of its own over a TCPStore: the collectives tensor parallel needs.

Not torch.distributed's global default group: one process can hold several groups (an engine
per test, a benchmark building TP=1 and TP=2 engines) and tear each down alone. The group's
collectives are the ``ProcessGroup`` object's own (gloo on CPU, NCCL on CUDA).

    rank 0 (driver)                          rank r (worker)
    store = open_store(host, port=0)         connect to (host, store.port)
    spawn workers with store.port ─────────► CommGroup(rank=r, ...)
    CommGroup(rank=0, ...)      ◄── rendezvous through the store ──►
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

# a collective that sees no peer for this long fails instead of waiting forever (a dead peer
# closes its sockets and fails the collective at once; this bounds a peer that hangs)
DEFAULT_TIMEOUT_S = 300.0


def open_store(host: str, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store, served by rank 0 on a free port (``store.port``)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, world_size: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


class CommGroup:
    """``world_size`` ranks; ``bind_host`` is the address this rank's gloo sockets use; ``shm``
    the ranks' ``shm_allreduce.ShmAllReduce`` when they share a machine."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, bind_host: str,
                 backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 shm=None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        elif backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            raise ValueError(f"collective backend must be gloo or nccl, got {backend!r}")
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        # every rank local: all-reduces that fit go through shared memory (a ShmAllReduce);
        # the choice depends only on the tensor, so all ranks make it alike
        self.shm = shm

    # -------------------------------------------------------------- tensors
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (every rank ends with the same values)."""
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on every rank), in rank order."""
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self.pg.allgather([outs], [t.contiguous()]).wait()
        return outs

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.pg.broadcast(t, src).wait()
        return t

    # -------------------------------------------------------------- objects
    def broadcast_object(self, obj=None, src: int = 0):
        """Rank ``src`` sends ``obj`` (pickled), every other rank returns it: a size, then the
        bytes (two broadcasts)."""
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            self.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), src)
            self.broadcast(data.to(self.device), src)
            return obj
        size = self.broadcast(torch.zeros(1, dtype=torch.int64, device=self.device), src)
        data = self.broadcast(torch.empty(int(size.item()), dtype=torch.uint8,
                                          device=self.device), src)
        return pickle.loads(data.cpu().numpy().tobytes())
