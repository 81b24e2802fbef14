"""Optional compiled CPU kernels (``csrc/``) for the decode step: fused RMSNorm, SwiGLU, rotary,
a register-tiled linear kernel, paged decode attention, QUEST sparse decode, and ``DecodeStack``
(a whole Llama decode step).

``cpu_kernels()`` builds the extension on first use with ``torch.utils.cpp_extension`` (g++ and
ninja; ~1 minute once, then cached under ``~/.cache/kvforge/kernels``) and returns the module,
or None when kernels are disabled (``KVFORGE_KERNELS=0``) or cannot be built here — callers then
use plain PyTorch ops, so the engine runs (slower) without a compiler. The wrappers that pick
kernel vs fallback are in ``ops.py``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "bindings.cpp"]     # unity build: it includes the other .cpp files
_UNSET = object()
_module = _UNSET


def kernels_enabled() -> bool:
    return os.environ.get("KVFORGE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _build_dir() -> Path:
    # -march=native code is only valid on this kind of CPU: key the cache by CPU flags + torch.
    # The sources' directory is in the key too: torch's build.ninja names absolute source paths,
    # so two checkouts sharing one directory would rewrite it and rebuild (~1 minute) in turn.
    try:
        cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    digest = hashlib.sha256(f"{cpu}|{torch.__version__}|{_CSRC.resolve()}".encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.read_bytes())
    key = digest.hexdigest()
    root = Path(os.environ.get("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge"))
    return root / "kernels" / key[:16]


def cpu_kernels():
    """The compiled kernel module, or None (disabled, or the build failed: logged once)."""
    global _module
    if _module is not _UNSET:
        return _module
    _module = None
    if not kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load
        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        logger.info("loading kvforge CPU kernels (built once per machine, about a minute)")
        _module = load(name="kvforge_cpu_kernels", sources=[str(p) for p in _SOURCES],
                       build_directory=str(build_dir), verbose=False,
                       extra_cflags=["-O3", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"])
    except Exception as exc:   # no compiler / ninja / headers: run on PyTorch ops instead
        logger.warning("kvforge CPU kernels unavailable (%s: %s); using PyTorch ops",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return _module
