"""The shared-memory all-reduce sums like gloo: two processes, several calls and sizes (slots
reused only after every rank read them); a rank whose peer is gone stops waiting."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from kvforge.distributed.shm_allreduce import ShmAllReduce

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


def test_a_wait_for_a_gone_peer_ends_in_an_error():
    """Rank 1 never comes: rank 0's wait asks its peer check, whose error ends the call (the
    engine turns it into the dead worker's report), instead of spinning forever."""
    name = f"kvforge-test-allreduce-gone-{os.getpid()}"
    checks = []

    def peer_check():
        checks.append(time.monotonic())
        if len(checks) >= 3:
            raise RuntimeError("peer 1 is gone")

    shm = ShmAllReduce(name, 0, 2, 64, create=True, peer_check=peer_check)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="peer 1 is gone"):
            shm.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 5.0
        with pytest.raises(ValueError, match="at most 64 bytes"):
            shm.all_reduce(torch.ones(17))
    finally:
        shm.close()
    assert not os.path.exists(f"/dev/shm/{name}")
