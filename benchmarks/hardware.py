"""What machine we ran on, and what it can do: fp32 GEMM peak and memory read bandwidth,
measured in the same process as the benchmark so the ratios are against the same conditions."""
from __future__ import annotations

import os
import time

import torch

from kvforge.kernels.huge_pages import huge_page_bytes, huge_page_zeros
from kvforge.kernels.isa import cpu_model_name  # noqa: F401 (re-exported for the scripts)


def physical_cores() -> int:
    """Physical cores (hyper-threads excluded); the default torch thread count."""
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except ImportError:
        pass
    return os.cpu_count() or 1


def cache_sizes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> str:
    """'L1d 32K L2 512K L3 16384K' from sysfs ('' where the kernel does not say)."""
    parts = []
    try:
        for index in sorted(os.listdir(cpu_dir)):
            if not index.startswith("index"):
                continue
            def read(name: str) -> str:
                with open(os.path.join(cpu_dir, index, name), encoding="utf-8") as f:
                    return f.read().strip()
            kind = read("type")
            if kind == "Instruction":
                continue
            parts.append(f"L{read('level')}{'d' if kind == 'Data' else ''} {read('size')}")
    except OSError:
        pass
    return " ".join(parts)


def kernels_line() -> str:
    """Which compiled-kernel build runs (KVFORGE_ISA) and what the CPU could run."""
    from kvforge.kernels import kernels_enabled
    from kvforge.kernels.isa import selected_isa, supported_isas
    if not kernels_enabled():
        return "kernels off (KVFORGE_KERNELS=0)"
    asked = os.environ.get("KVFORGE_ISA", "auto")
    return (f"kernels {selected_isa()} (KVFORGE_ISA={asked}; CPU runs "
            f"{', '.join(supported_isas())})")


def hardware_line() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    caches = cache_sizes()
    return (f"hardware: {cpu_model_name()} | {physical_cores()} physical cores, "
            f"{os.cpu_count()} logical{' | ' + caches if caches else ''} | "
            f"{kernels_line()} | torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads | load avg {load}")


def best_seconds(fn, reps: int) -> float:
    """Fastest of ``reps`` timed calls (after one untimed warm-up call)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_gemm_peak_flops(n: int = 2048, reps: int = 5) -> float:
    """Achievable fp32 matmul FLOP/s: best of ``reps`` n x n @ n x n products."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    seconds = best_seconds(lambda: torch.mm(a, b, out=out), reps)
    return 2.0 * n ** 3 / seconds


class ReadBandwidthSampler:
    """Samples of sustained memory read bandwidth (bytes/s): each as many ``sum()`` passes over
    one fp32 tensor far larger than any cache as fill ``sample_seconds`` (at least one pass).

    Long samples measure what a run of that length can sustain: on a shared VM a single ~30 ms
    pass now and then reads 40-60% faster than any second-long stretch, and the rate itself
    drifts between modes (~30 and ~50-60 GB/s here) over seconds, so a benchmark compares a run
    with the samples taken right before and after it (see benchmarks/latency.py).

    The tensor lives in huge pages where the machine grants them (kernels/huge_pages.py), as
    kvforge's weights do: a pass over 2 MiB pages reads up to ~1.1-1.3x faster than one over
    4 KiB pages here, so a 4 KiB tensor would understate the bandwidth, i.e. the bound."""

    def __init__(self, num_bytes: int = 1 << 30, sample_seconds: float = 0.0) -> None:
        if num_bytes < 4:
            raise ValueError(f"num_bytes must be >= 4, got {num_bytes}")
        self.sample_seconds = sample_seconds
        self._data = huge_page_zeros([(num_bytes // 4,)])[0]
        self._data.fill_(1.0)                  # first touch: page faults are not bandwidth
        self.huge_pages = huge_page_bytes(self._data) > 0

    def sample(self) -> float:
        passes, t0 = 0, time.perf_counter()
        while True:
            self._data.sum()
            passes += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= self.sample_seconds:
                return passes * self._data.numel() * 4 / elapsed
