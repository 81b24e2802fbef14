"""The benchmark's shared-memory all-reduce sums like gloo: two processes, several calls and
sizes (slots reused only after every rank read them)."""
from __future__ import annotations

import multiprocessing as mp
import os

import torch

from benchmarks.shm_allreduce import ShmAllReduce

SIZES = [1, 7, 1024, 3, 4096]


def _inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=g) for n in SIZES]


def _peer(name: str, results) -> None:
    shm = ShmAllReduce(name, 1, 2, 4096 * 4, create=False)
    results.put([shm.all_reduce(t).tolist() for t in _inputs(1)])


def test_two_ranks_get_the_same_sums():
    name = f"kvforge-test-allreduce-{os.getpid()}"
    shm = ShmAllReduce(name, 0, 2, 4096 * 4, create=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(name, results), daemon=True)
    peer.start()
    try:
        ours = [shm.all_reduce(t).tolist() for t in _inputs(0)]
        theirs = results.get(timeout=120)
    finally:
        peer.join(30)
        shm.close()
    expected = [(a + b).tolist() for a, b in zip(_inputs(0), _inputs(1))]
    assert ours == theirs == expected
    assert not os.path.exists(f"/dev/shm/{name}")
