"""Which instruction set the compiled kernels are built for, chosen at run time.

The kernels are compiled once per ISA (``-march=x86-64-v3`` for AVX2 + FMA, ``-march=x86-64-v4``
for AVX-512), never for the build machine alone (``-march=native`` would make a build that
crashes on a user's older CPU, and a suite that only ever tests the build machine's paths).

``KVFORGE_ISA`` picks one:

    auto     (default) the widest this CPU runs: avx512 > avx2 > native
    avx2     AVX2 + FMA (x86-64-v3): every x86 CPU of the last decade
    avx512   AVX-512 F/BW/CD/DQ/VL (x86-64-v4)
    native   whatever the compiler finds here (-march=native): CPUs that are not x86

Asking for an ISA this CPU lacks is an error: its code would die on an illegal instruction.
"""
from __future__ import annotations

import functools
import os
import platform

ENV_VAR = "KVFORGE_ISA"

# ISA -> (compiler flags, CPU flags it needs in /proc/cpuinfo)
_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
ISA_TABLE: dict[str, tuple[list[str], frozenset[str]]] = {
    "avx2": (["-march=x86-64-v3", "-mtune=generic"], _X86_V3),
    "avx512": (["-march=x86-64-v4", "-mtune=generic"],
               _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "native": (["-march=native"], frozenset()),
}
# widest first: what "auto" takes
_PREFERENCE = ("avx512", "avx2", "native")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ("AMD EPYC 7B12"), or what the platform module knows."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@functools.lru_cache(maxsize=1)
def _supported() -> tuple[str, ...]:
    if not _is_x86():
        return ("native",)
    flags = cpu_flags()
    return tuple(isa for isa in _PREFERENCE if isa != "native" and ISA_TABLE[isa][1] <= flags) + (
        "native",)


def supported_isas() -> list[str]:
    """The ISAs whose kernels run on this CPU, widest first."""
    return list(_supported())


def selected_isa() -> str:
    """The ISA ``KVFORGE_ISA`` asks for (``auto``: the widest supported). Raises ValueError for an
    unknown name and RuntimeError for an ISA this CPU cannot run."""
    wanted = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if wanted == "auto":
        return supported_isas()[0]
    if wanted not in ISA_TABLE:
        raise ValueError(f"{ENV_VAR}={wanted!r} is not one of auto, {', '.join(ISA_TABLE)}")
    if wanted not in supported_isas():
        raise RuntimeError(f"{ENV_VAR}={wanted}: this CPU cannot run {wanted} code "
                           f"(it runs: {', '.join(supported_isas())})")
    return wanted


def compile_flags(isa: str) -> list[str]:
    if isa not in ISA_TABLE:
        raise ValueError(f"unknown ISA {isa!r}; one of {', '.join(ISA_TABLE)}")
    return list(ISA_TABLE[isa][0])
