"""What the disk tier's reads cost the compute beside them: the question behind an offloaded
step taking longer than max(load, compute).

A thread reads a fresh probe file of the disk tier with direct I/O (the offload loader's
reads) while the caller runs the GEMM of a decode block's rows (128 x 2048 by 2048 x 2048
fp32, the calibration's); each request size is timed alone and beside the GEMM. Reported per
row: the read rate alone and beside the GEMM, the GEMM's slowdown, where the two vCPUs' time
went meanwhile (``/proc/stat``: steal is time the hypervisor ran something else on them, on
a VM often the virtual disk itself), and the GEMM's CPU-seconds lost per GB read.

    .venv/bin/python benchmarks/offload_contention.py              # ~1 min
    .venv/bin/python benchmarks/offload_contention.py --sizes 1MiB 16MiB --threads 1 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table  # noqa: E402
from kvforge.config import parse_bytes  # noqa: E402
from kvforge.offload.calibrate import (CONTENTION_ROWS, CONTENTION_SIZE,  # noqa: E402
                                       layer_linear, repeat_for)
from kvforge.offload.direct_io import ALIGN, probe_file, read_rate, read_while  # noqa: E402

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> list[int]:
    """The machine's cumulative CPU time by kind (``/proc/stat``'s first line, in ticks)."""
    with open("/proc/stat", encoding="ascii") as f:
        return [int(v) for v in f.readline().split()[1:1 + len(CPU_FIELDS)]]


def shares(before: list[int], after: list[int]) -> dict[str, float]:
    delta = [b - a for a, b in zip(before, after)]
    total = max(sum(delta), 1)
    return {name: d / total for name, d in zip(CPU_FIELDS, delta)}


def measure(directory: str, chunk: int, threads: int, probe_bytes: int, seconds: float,
            mkl: bool) -> dict:
    torch.set_num_threads(threads)
    with torch.inference_mode(), probe_file(directory, probe_bytes, chunk) as (path, _):
        cpu0 = time.process_time()
        alone_rate = read_rate(path, probe_bytes, chunk)
        reader_cpu = (time.process_time() - cpu0) / (probe_bytes / 1e9)   # the guest's own
        # the calibration's GEMM: the layers' linear (compiled kernel, else MKL), or MKL's
        w = torch.randn(CONTENTION_SIZE, CONTENTION_SIZE)
        x = torch.randn(CONTENTION_ROWS, CONTENTION_SIZE)
        linear = torch.nn.functional.linear if mkl else layer_linear
        work, per_call, reps = repeat_for(lambda: linear(x, w), seconds)
        before = cpu_times()
        rate, busy = read_while(path, work, probe_bytes, chunk)
        spent = shares(before, cpu_times())
    slowdown = busy / (reps * per_call)
    lost = busy - reps * per_call                     # wall seconds the GEMM lost ...
    return {"threads": threads, "chunk": chunk, "read_alone": alone_rate, "read_busy": rate,
            "reader_cpu_s_per_gb": reader_cpu,
            "slowdown": slowdown, "spent": spent,
            # ... on each of its threads: CPU-seconds, per GB the reader moved meanwhile
            "cpu_s_per_gb": lost * threads / max(rate * busy / 1e9, 1e-9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offload-dir", default=os.path.expanduser("~/.cache/kvforge/offload"))
    p.add_argument("--sizes", nargs="+", default=["256KiB", "1MiB", "4MiB", "16MiB"],
                   help="direct-read request sizes")
    p.add_argument("--threads", nargs="+", type=int, default=[2, 1], help="GEMM threads")
    p.add_argument("--probe", default="256MiB", help="probe file size")
    p.add_argument("--seconds", type=float, default=2.0, help="GEMM time alone per row")
    p.add_argument("--mkl", action="store_true",
                   help="MKL's GEMM (static split of the work) instead of the compiled kernel")
    args = p.parse_args(argv)
    probe_bytes = parse_bytes(args.probe)
    hardware = hardware_line()          # before the rows change the thread count
    chunks = [parse_bytes(size) for size in args.sizes]
    for size, chunk in zip(args.sizes, chunks):      # before any measuring, in the user's words
        if chunk % ALIGN or probe_bytes % chunk:
            raise ValueError(f"request size {size!r} must be a multiple of {ALIGN} bytes "
                             f"dividing the probe ({args.probe})")
    results = [measure(args.offload_dir, chunk, threads, probe_bytes, args.seconds, args.mkl)
               for threads in args.threads for chunk in chunks]
    print(f"{hardware} | GEMM: {'MKL' if args.mkl else 'compiled kernel where it applies'}")
    headers = ["GEMM threads", "request KiB", "read GB/s alone", "reader CPU-s / GB alone",
               "read GB/s beside GEMM", "GEMM slowdown", "steal %", "system+irq %", "iowait %",
               "GEMM CPU-s lost / GB"]
    rows = [[r["threads"], r["chunk"] >> 10, r["read_alone"] / 1e9, r["reader_cpu_s_per_gb"],
             r["read_busy"] / 1e9,
             r["slowdown"], 100 * r["spent"]["steal"],
             100 * (r["spent"]["system"] + r["spent"]["irq"] + r["spent"]["softirq"]),
             100 * r["spent"]["iowait"], r["cpu_s_per_gb"]] for r in results]
    print(format_table(headers, rows))
    two = [r for r in results if r["threads"] == max(args.threads)] or results

    def span(values, fmt: str) -> str:
        values = list(values)
        return f"{min(values):{fmt}}-{max(values):{fmt}}"

    kernel = "MKL" if args.mkl else "compiled"
    print(f"SUMMARY offload_contention ({hardware}; {kernel} GEMM): a "
          f"{max(args.threads)}-thread GEMM runs {span((r['slowdown'] for r in two), '.2f')}x "
          f"slower beside direct reads of {span((r['chunk'] >> 10 for r in two), 'd')} KiB "
          f"requests ({span((r['read_busy'] / 1e9 for r in two), '.2f')} GB/s); steal "
          f"{span((100 * r['spent']['steal'] for r in two), '.0f')}% of the CPUs meanwhile; "
          f"{span((r['cpu_s_per_gb'] for r in two), '.2f')} CPU-s of compute lost per GB read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
