"""Run-time choice of the kernels' instruction set (kvforge/kernels/isa.py, KVFORGE_ISA)."""
from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

import kvforge.kernels as kernels
from kvforge.kernels import isa, ops

needs_kernels = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


def test_auto_takes_the_widest_supported(monkeypatch):
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    assert isa.selected_isa() == isa.supported_isas()[0]
    monkeypatch.setenv(isa.ENV_VAR, "auto")
    assert isa.selected_isa() == isa.supported_isas()[0]


def test_detection_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(isa, "_is_x86", lambda: True)
    v3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe"
    for flags, expected in [(v3, ["avx2", "native"]),
                            (v3 + " avx512f avx512bw avx512cd avx512dq avx512vl",
                             ["avx512", "avx2", "native"]),
                            (v3 + " avx512f", ["avx2", "native"]),          # no BW/DQ/VL: v3 only
                            ("fpu sse2 avx", ["native"])]:
        monkeypatch.setattr(isa, "cpu_flags", lambda f=flags: frozenset(f.split()))
        isa._supported.cache_clear()
        assert isa.supported_isas() == expected, flags
    isa._supported.cache_clear()


def test_bad_or_unsupported_isa_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        isa.selected_isa()
    monkeypatch.setattr(isa, "_supported", lambda: ("avx2", "native"))
    monkeypatch.setenv(isa.ENV_VAR, "avx512")
    with pytest.raises(RuntimeError, match="cannot run avx512"):
        isa.selected_isa()
    monkeypatch.setenv(isa.ENV_VAR, "AVX2")
    assert isa.selected_isa() == "avx2"


def test_packed_weights_override(monkeypatch):
    if kernels.cpu_kernels() is None:
        pytest.skip("no compiled kernels")
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "1")
    assert ops.packing_pays()
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "0")
    assert not ops.packing_pays()
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "auto")
    assert ops.packing_pays() == bool(kernels.cpu_kernels().linear_packing_pays)
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "maybe")
    with pytest.raises(ValueError, match="maybe"):
        ops.packing_pays()


@needs_kernels
def test_env_selects_the_build(monkeypatch):
    """KVFORGE_ISA picks the module the ops use; each ISA is a module of its own, so builds for
    two ISAs live side by side in one process and agree on a product."""
    runnable = [name for name in ("avx2", "avx512") if name in isa.supported_isas()]
    if not runnable:
        pytest.skip("not an x86 CPU with AVX2")
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    results = []
    for name in runnable:
        monkeypatch.setenv(isa.ENV_VAR, name)
        kernels.reselect_kernels()
        module = kernels.cpu_kernels()
        assert module is kernels.cpu_kernels(name)
        assert module.__name__ == f"kvforge_cpu_kernels_{name}"
        assert module.linear_lanes == {"avx2": 8, "avx512": 16}[name]
        results.append(module.linear_rows(x, w))
    kernels.reselect_kernels()
    for y in results:
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("name", ["avx2", "avx512"])
def test_every_isa_compiles_on_any_x86_box(name, tmp_path):
    """A CPU without AVX-512 cannot run that build, but it can compile it: every x86 box checks
    that each ISA's kernels still build (compile only, -O1 for speed; nothing is run)."""
    if "avx2" not in isa.supported_isas():
        pytest.skip("not an x86 machine")
    from torch.utils.cpp_extension import include_paths
    source = Path(kernels.__file__).with_name("csrc") / "bindings.cpp"
    cmd = ["g++", "-std=c++17", "-O1", "-fopenmp", "-fPIC", *isa.compile_flags(name),
           "-DTORCH_EXTENSION_NAME=kvforge_compile_check", "-D_GLIBCXX_USE_CXX11_ABI="
           f"{int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}",
           "-c", str(source), "-o", str(tmp_path / "check.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    objdump = shutil.which("objdump")
    if objdump and name == "avx2":     # the AVX2 build must not use a single 512-bit register
        text = subprocess.run([objdump, "-d", str(tmp_path / "check.o")], capture_output=True,
                              text=True).stdout
        assert "%zmm" not in text
