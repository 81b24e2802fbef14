"""The input-sparse kernels (kernels/csrc/sparse_gemv.cpp) against masked dense PyTorch math,
once per ISA build this CPU runs (an AVX-512 build is compiled by tests/kernels/test_isa.py and
run here where the CPU has it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvforge.kernels as kernels
from kvforge.kernels.isa import supported_isas
from tests.kernels.test_cpu_kernels import ISA_PARAMS, needs_kernels

pytestmark = needs_kernels


@pytest.fixture(scope="module", params=ISA_PARAMS)
def compiled(request):
    module = kernels.cpu_kernels(request.param)
    assert module is not None, f"the {request.param} kernels failed to build"
    return module


def _masked(x, t):
    return x * (x.abs() > t)


def _threshold(values, level):
    """Halfway between two neighbouring magnitudes near the ``level`` quantile: no value sits
    on the threshold, where one ulp between the kernel's and torch's math would flip it."""
    if level == 0:
        return 0.0
    v = values.abs().flatten().sort().values
    i = min(int(level * v.numel()), v.numel() - 1)
    return float((v[i - 1] + v[i]) / 2)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(960, 576), (45, 37), (576, 1536)])   # (out, in)
@pytest.mark.parametrize("level", [0.0, 0.5, 0.9])
def test_sparse_projection_fp32(compiled, threads, rows, shape, level):
    torch.manual_seed(rows * 7 + shape[0])
    out, k = shape
    w, b, x = torch.randn(out, k), torch.randn(out), torch.randn(rows, k)
    t = _threshold(x, level)
    sp = compiled.SparseProjection(w.t().contiguous(), t, bias=b)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = sp.forward(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(y, _masked(x, t) @ w.t() + b, rtol=1e-4, atol=1e-4)
    if level >= 0.5:       # the mask matters: the dense product differs
        assert not torch.allclose(y, x @ w.t() + b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", [(960, 576), (45, 37)])
def test_sparse_projection_int8(compiled, rows, shape):
    torch.manual_seed(3)
    out, k = shape
    q = torch.randint(-127, 128, (out, k), dtype=torch.int8)
    scale = torch.rand(out) / 100
    x = torch.randn(rows, k)
    t = _threshold(x, 0.5)
    sp = compiled.SparseProjection(q.t().contiguous(), t, scales=scale)
    ref = _masked(x, t) @ (q.float() * scale[:, None]).t()
    torch.testing.assert_close(sp.forward(x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("hidden,inter", [(64, 128), (576, 1536), (40, 37)])
def test_cats_mlp(compiled, int8, rows, hidden, inter):
    torch.manual_seed(hidden + rows)
    gate_up, down = torch.randn(2 * inter, hidden) / 8, torch.randn(hidden, inter) / 8
    gu_scale = down_scale = None
    if int8:
        gq = torch.randint(-127, 128, gate_up.shape, dtype=torch.int8)
        dq = torch.randint(-127, 128, down.shape, dtype=torch.int8)
        gu_scale, down_scale = torch.rand(2 * inter) / 500, torch.rand(hidden) / 500
        gate_up, down = gq.float() * gu_scale[:, None], dq.float() * down_scale[:, None]
        gate_up_w, down_w = gq, dq
    else:
        gate_up_w, down_w = gate_up, down
    h = torch.randn(rows, hidden)
    g = F.silu(h @ gate_up[:inter].t())
    t = _threshold(g, 0.5)
    mlp = compiled.CatsMlp(gate_up_w.contiguous(), down_w.t().contiguous(), t,
                           gate_up_scales=gu_scale, down_scales=down_scale)
    ref = (g * (g.abs() > t) * (h @ gate_up[inter:].t())) @ down.t()
    torch.testing.assert_close(mlp.forward(h), ref, rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise(compiled):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="threshold must be >= 0"):
        compiled.SparseProjection(w, -1.0)
    with pytest.raises(RuntimeError, match="float32 or int8"):
        compiled.SparseProjection(w.double(), 0.1)
    with pytest.raises(RuntimeError, match="needs its scales"):
        compiled.SparseProjection(w.to(torch.int8), 0.1)
    sp = compiled.SparseProjection(w, 0.1)
    with pytest.raises(RuntimeError, match=r"x must be \[1\.\.4, 8\]"):
        sp.forward(torch.randn(5, 8))          # more rows than the sparse path takes
    with pytest.raises(RuntimeError, match="gate_up rows must be 2 x"):
        compiled.CatsMlp(torch.randn(10, 8), torch.randn(4, 8), 0.1)


def test_avx512_selectable_or_skipped():
    """The AVX-512 build exists as its own module where the CPU runs it; elsewhere the
    compile-only check in tests/kernels/test_isa.py covers sparse_gemv.cpp with the rest."""
    if "avx512" not in supported_isas():
        pytest.skip("this CPU cannot run avx512 code")
    assert kernels.cpu_kernels("avx512").sparse_rows_max == 4
