"""How many torch threads an engine process runs: the physical cores, shared out among the
tensor-parallel ranks of one machine."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.config import EngineConfig


def default_num_threads() -> int:
    # physical cores: hyper-threads slow fp32 GEMM down
    try:
        cores = {line.split(":")[1].strip() for line in open("/proc/cpuinfo")
                 if line.startswith("core id")}
        sockets = {line.split(":")[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("physical id")}
        n = len(cores) * max(len(sockets), 1)
    except OSError:
        n = 0
    return max(1, min(n or os.cpu_count() or 1, os.cpu_count() or 1))


def threads_per_rank(config: "EngineConfig") -> int:
    """``num_threads`` when given, else the physical cores shared out among the tensor-parallel
    ranks (one rank: all of them)."""
    return config.num_threads or max(1, default_num_threads() // config.tensor_parallel_size)
