"""Optional compiled CPU kernels (``csrc/``) for the decode step: fused RMSNorm, SwiGLU, rotary,
a register-tiled linear kernel, paged decode attention, QUEST sparse decode, and ``DecodeStack``
(a whole Llama decode step).

``cpu_kernels()`` builds the extension for the ISA ``KVFORGE_ISA`` selects (``isa.py``: AVX2 or
AVX-512, the widest this CPU runs by default) on first use with ``torch.utils.cpp_extension``
(g++ and ninja; ~1 minute once per ISA, then cached under ``~/.cache/kvforge/kernels``, and
imported directly by later starts) and returns the module, or None when kernels are disabled
(``KVFORGE_KERNELS=0``) or cannot be built here — callers then use plain PyTorch ops, so the
engine runs (slower) without a compiler. The wrappers that pick kernel vs fallback are in
``ops.py``. Each ISA's build is a module of its own
(``kvforge_cpu_kernels_avx2``, ...), so one process can load both (the tests compare them).
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from kvforge.kernels.isa import compile_flags, selected_isa

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "bindings.cpp"]     # unity build: it includes the other .cpp files
_UNSET = object()
_module = _UNSET                        # the module KVFORGE_ISA / KVFORGE_KERNELS select
_builds: dict[str, object] = {}         # ISA -> module, or None where its build failed


def kernels_enabled() -> bool:
    return os.environ.get("KVFORGE_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _build_dir(isa: str) -> Path:
    # Keyed by ISA, compiler flags and torch (not by this CPU: an AVX2 build runs on any AVX2
    # CPU). The sources' directory is in the key too: torch's build.ninja names absolute source
    # paths, so two checkouts sharing one directory would rewrite it and rebuild in turn.
    digest = hashlib.sha256(
        f"{isa}|{compile_flags(isa)}|{torch.__version__}|{_CSRC.resolve()}".encode())
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.read_bytes())
    key = digest.hexdigest()
    root = Path(os.environ.get("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge"))
    return root / "kernels" / f"{isa}-{key[:16]}"


# written beside a build once torch's loader has built and imported it: the library's size and
# mtime, so a later start imports it directly (see _import_built)
_BUILT_MARKER = "kvforge.built"


def _import_built(build_dir: Path, name: str):
    """The module of a finished build in ``build_dir``, imported directly; None when there is
    none (no marker, or the library changed since: a rebuild in progress or torch's loader
    must check the build). Importing torch's ``cpp_extension`` (setuptools with it) and asking
    ninja whether the build is current cost ~0.1 s of every start; the directory's name already
    hashes the sources, flags and torch version, so a marked library is current."""
    import importlib.util
    import json
    import sys
    library = build_dir / f"{name}.so"
    try:
        marker = json.loads((build_dir / _BUILT_MARKER).read_text())
        stat = library.stat()
    except (OSError, ValueError):
        return None
    if marker != {"library": library.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
        return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    sys.modules[name] = module
    return module


def _mark_built(build_dir: Path, name: str) -> None:
    import json
    try:
        stat = (build_dir / f"{name}.so").stat()
    except OSError:                 # no library where torch's loader was asked to put it
        return
    tmp = build_dir / f"{_BUILT_MARKER}.tmp{os.getpid()}"
    try:                            # an optimisation only: a start without it asks torch's loader
        tmp.write_text(json.dumps({"library": f"{name}.so", "size": stat.st_size,
                                   "mtime_ns": stat.st_mtime_ns}))
        tmp.replace(build_dir / _BUILT_MARKER)
    except OSError:
        tmp.unlink(missing_ok=True)


def build_kernels(isa: str):
    """Build (or load the cached build of) the kernels for ``isa``; raises if the build fails.
    Loading a module does not run its code: building another ISA's kernels is safe anywhere."""
    build_dir = _build_dir(isa)
    name = f"kvforge_cpu_kernels_{isa}"
    built = _import_built(build_dir, name)
    if built is not None:
        return built
    import fcntl
    from torch.utils.cpp_extension import load
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading kvforge CPU kernels for %s (built once per machine, about a minute)",
                isa)
    # torch serializes builds with a "lock" file that a killed builder leaves behind, and every
    # later load then waits for it forever. An flock is released by the kernel when its holder
    # dies: whoever holds ours is the only kvforge process building here, so a "lock" file it
    # finds is stale and goes.
    with open(build_dir / "kvforge.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        module = load(name=name, sources=[str(p) for p in _SOURCES],
                      build_directory=str(build_dir), verbose=False,
                      extra_cflags=["-O3", *compile_flags(isa), "-fopenmp"],
                      extra_ldflags=["-fopenmp"])
        _mark_built(build_dir, name)
        return module


def cpu_kernels(isa: str | None = None):
    """The compiled kernel module for ``isa``, or None (disabled, or the build failed: logged
    once per ISA). Without ``isa``: the module the environment selects (``KVFORGE_KERNELS``,
    ``KVFORGE_ISA``), decided at the first call and kept (callers run this per layer)."""
    global _module
    if isa is None:
        if _module is _UNSET:
            _module = cpu_kernels(selected_isa()) if kernels_enabled() else None
        return _module
    if isa not in _builds:
        module = None
        try:
            module = build_kernels(isa)
        except Exception as exc:   # no compiler / ninja / headers: run on PyTorch ops instead
            logger.warning("kvforge CPU kernels (%s) unavailable (%s: %s); using PyTorch ops",
                           isa, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        _builds[isa] = module
    return _builds[isa]


def reselect_kernels() -> None:
    """Forget the environment's choice: the next ``cpu_kernels()`` reads it again."""
    global _module
    _module = _UNSET
