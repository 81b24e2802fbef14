"""Hardware constants of the cost model, measured once and cached: the disk tier's direct-read
bandwidth and small-write latency, the time a linear layer takes per million fp32 parameters at
a few row counts (memory-bound at few rows, compute-bound at many), and what reads and compute
cost each other when they overlap. ``kvforge offload calibrate`` runs it."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from kvforge.offload.direct_io import (measure_block_write_s, measure_disk_bandwidth, probe_file,
                                       read_while)

CALIBRATION_ROWS = (1, 8, 32, 128, 512)
CONTENTION_ROWS = 128            # a decode block's rows (16 batches of 8): the step's GEMMs
CONTENTION_SIZE = 2048           # its weights: 2048 x 2048 fp32, 16 MB, past the caches
CONTENTION_SECONDS = 1.0
CACHE_PATH = os.path.expanduser("~/.cache/kvforge/offload_calibration.json")


@dataclass
class HardwareCosts:
    disk_read_bytes_per_s: float
    disk_write_bytes_per_s: float
    # seconds per million fp32 weights of a linear layer at each row count (CALIBRATION_ROWS)
    linear_s_per_mparam: dict[int, float]
    memory_bytes_per_s: float             # streaming reads from RAM (attention over the KV)
    per_layer_call_s: float = 2e-4        # Python + small ops of one layer call on one batch
    # one KV block's plane written back (a small direct write: latency-bound, not bytes)
    disk_block_write_s: float = 1.1e-4
    # Reads and compute at once (the loaders beside the layers). On a VM the two can take each
    # other's CPU: on a 2-core EPYC VM direct reads ran at ~0.6 of their rate beside a 2-thread
    # GEMM and slowed it by 30-90%, so an overlapped step is longer than max(io, compute).
    disk_read_contended_bytes_per_s: float | None = None     # None: the rate alone
    compute_contended_slowdown: float = 1.0                  # GEMM time beside reads / alone

    @property
    def disk_read_beside_compute_bytes_per_s(self) -> float:
        return self.disk_read_contended_bytes_per_s or self.disk_read_bytes_per_s

    def overlapped_seconds(self, io: float, compute: float) -> float:
        """Seconds of ``io`` (seconds of reads alone) and ``compute`` (seconds alone) run at
        once: both at their contended rates while both run, the one left at its own rate
        after the other ends. Without contention it is max(io, compute)."""
        if io <= 0 or compute <= 0:
            return io + compute
        io_both = io * self.disk_read_bytes_per_s / self.disk_read_beside_compute_bytes_per_s
        compute_both = compute * self.compute_contended_slowdown
        if io_both <= compute_both:
            return io_both + compute * (1 - io_both / compute_both)
        return compute_both + io * (1 - compute_both / io_both)

    def linear_seconds(self, params: float, rows: int) -> float:
        """Interpolated in log(rows) between the measured points; linear in rows past the last."""
        pts = sorted((int(r), s) for r, s in self.linear_s_per_mparam.items())
        rows = max(rows, 1)
        if rows >= pts[-1][0]:
            return params / 1e6 * pts[-1][1] * rows / pts[-1][0]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if r0 <= rows <= r1:
                f = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return params / 1e6 * (s0 + f * (s1 - s0))
        return params / 1e6 * pts[0][1]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "HardwareCosts":
        d = dict(d)
        d["linear_s_per_mparam"] = {int(k): float(v) for k, v in d["linear_s_per_mparam"].items()}
        return cls(**d)


def _cache_key(offload_dir: str) -> str:
    st = os.stat(offload_dir)
    return f"v5|{platform.node()}|{platform.processor()}|dev{st.st_dev}|threads{torch.get_num_threads()}"


def measure(offload_dir: str, probe_bytes: int = 256 << 20) -> HardwareCosts:
    disk_read, disk_write = measure_disk_bandwidth(offload_dir, probe_bytes)
    block_write = measure_block_write_s(offload_dir)
    n = k = CONTENTION_SIZE
    w = torch.randn(n, k)
    per_rows = {}

    def linear(x):
        return layer_linear(x, w)

    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, k)
            linear(x)
            reps = max(2, 64 // rows)
            start = time.perf_counter()
            for _ in range(reps):
                linear(x)
            per_rows[rows] = (time.perf_counter() - start) / reps / (n * k / 1e6)
        big = torch.ones(16 << 20)                 # 64 MB of fp32
        big.sum()
        start = time.perf_counter()
        for _ in range(3):
            big.sum()
        mem = 3 * big.numel() * 4 / (time.perf_counter() - start)
        # one decoder layer's ~12 small ops (norms, rotary, residual adds) on a tiny batch
        h = torch.randn(8, 256)
        start = time.perf_counter()
        for _ in range(200):
            for _ in range(12):
                h = h * 1.0
        per_call = (time.perf_counter() - start) / 200
        read_contended, slowdown = _measure_contention(offload_dir, probe_bytes, linear, k)
    return HardwareCosts(disk_read, disk_write, per_rows, mem, per_call, block_write,
                         min(read_contended, disk_read), slowdown)


def layer_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` by the op the layers run: the compiled few-rows kernel, else MKL."""
    from kvforge.kernels import ops as kernel_ops
    y = kernel_ops.linear_rows(x, w)
    return torch.nn.functional.linear(x, w) if y is None else y


def repeat_for(call, seconds: float):
    """(work, seconds per call alone, calls): ``call()`` repeated for about ``seconds`` (after
    one warm-up call), and ``work`` running it that many times again, to time beside
    something else."""
    call()
    start = time.perf_counter()
    reps = 0
    while time.perf_counter() - start < seconds:
        call()
        reps += 1
    alone = (time.perf_counter() - start) / reps

    def work() -> None:
        for _ in range(reps):
            call()

    return work, alone, reps


def _measure_contention(offload_dir: str, probe_bytes: int, linear,
                        k: int) -> tuple[float, float]:
    """(direct-read bytes/s beside the GEMM, the GEMM's time beside reads / alone): the
    GEMM of a decode block's rows for ~CONTENTION_SECONDS alone, then again while a thread
    reads a fresh probe file of the disk tier (written after the GEMM alone, as the read
    rate's own probe is: on a VM a file read seconds after its write can read 3x slower)."""
    x = torch.randn(CONTENTION_ROWS, k)
    work, alone, reps = repeat_for(lambda: linear(x), CONTENTION_SECONDS)
    with probe_file(offload_dir, probe_bytes) as (probe, _):
        rate, seconds = read_while(probe, work, probe_bytes)
    return rate, max(1.0, seconds / reps / alone)


def load_or_measure(offload_dir: str, refresh: bool = False,
                    cache_path: str = CACHE_PATH) -> tuple[HardwareCosts, bool]:
    """(costs, measured_now): the cached constants for this machine, disk and thread count."""
    os.makedirs(offload_dir, exist_ok=True)
    key = _cache_key(offload_dir)
    cache: dict = {}
    if os.path.exists(cache_path):
        try:
            with open(cache_path) as f:
                cache = json.load(f)
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return HardwareCosts.from_json(cache[key]), False
    costs = measure(offload_dir)
    cache[key] = costs.to_json()
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with open(cache_path, "w") as f:
        json.dump(cache, f, indent=1)
    return costs, True
