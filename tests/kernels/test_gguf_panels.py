"""The int8 panel path for many activation rows (csrc/gguf_gemm.cpp): the dequantized weights
times activations rounded to a step per 32 values, once per ISA build this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tests.kernels.test_cpu_kernels import compiled, needs_kernels  # noqa: F401 (fixture)
from tests.kernels.test_gguf_kernels import (random_blocks, reference_weight,
                                             uneven_activations, vnni_dots)

PANEL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


def rounded_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rounded as the panel path rounds it, in float64; the step of every value): a step per
    32 values, max |x| / 127, q = round-half-even(x * (127 / max |x|)) in float32."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)                                   # half to even, float32
    step = (amax / 127.0).double()
    return (q.double() * step).view_as(x), step.expand_as(blocks).reshape(x.shape)


def panel_weight(compiled, raws, types, k, gemm_min_rows=1):
    return compiled.GgufWeight([torch.from_numpy(r) for r in raws], [int(t) for t in types], k,
                               gemm_min_rows=gemm_min_rows, int8_panels=True)


@needs_kernels
@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n", [(1, 8), (5, 13), (33, 70), (70, 40)])
def test_panels_are_dequantized_weights_times_rounded_activations(compiled, qtype, rows, n):
    """Every type with a panel form, rows and columns that fill no tile evenly (tails of rows
    and of the 8-column panels): the output is W_dequantized @ x_rounded up to fp32 sums, and
    within the rounding bound of W @ x."""
    k = 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 608        # 608: 19 blocks of 32
    raw = random_blocks(qtype, n, k, seed=rows + int(qtype))
    w = torch.from_numpy(reference_weight(raw, qtype))
    x = uneven_activations(rows, k, seed=rows)
    y = panel_weight(compiled, [raw], [qtype], k).linear(x).double()
    x_q, step = rounded_activations(x)
    magnitude = x_q.abs() @ w.abs().T
    assert ((y - x_q @ w.T).abs() <= 1e-5 * magnitude + 1e-7).all()
    bound = (step / 2) @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T) + 1e-7
    assert ((y - x.double() @ w.T).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q4_1], ids=lambda t: t.name)
def test_a_panel_row_does_not_depend_on_the_others(compiled, qtype):
    """Each row is rounded on its own and summed in the same order whatever tile it lands in:
    a row gives the same bits alone, in a tail tile, or among 70."""
    n, k = 24, 512
    weight = panel_weight(compiled, [random_blocks(qtype, n, k, seed=3)], [qtype], k)
    x = uneven_activations(70, k, seed=9)
    y = weight.linear(x)
    for i in (0, 3, 4, 66, 69):
        assert torch.equal(y[i:i + 1], weight.linear(x[i:i + 1]))
    assert torch.equal(y[5:12], weight.linear(x[5:12]))


@needs_kernels
def test_forced_many_rows_take_panels_at_any_count_where_every_shard_has_them(compiled):
    """``force_many_rows`` (prompt rows, layers/prompt_rows.py): below the crossover a weight
    whose shards are all on panels gives each row the bits it gets among 70 rows; a weight with
    a shard off panels (Q8_0: fp32 tiles) keeps the dots there, as without the flag."""
    k = 256
    on_panels = panel_weight(compiled, [random_blocks(T.Q4_K, 24, k, seed=4),
                                        random_blocks(T.Q6_K, 8, k, seed=5)],
                             [T.Q4_K, T.Q6_K], k, gemm_min_rows=16)
    x = uneven_activations(70, k, seed=2)
    many = on_panels.linear(x)
    for a, b in ((0, 1), (7, 10), (60, 75)):
        assert torch.equal(on_panels.linear(x[a:b], force_many_rows=True), many[a:b])
    assert not torch.equal(on_panels.linear(x[7:10]), many[7:10])          # the dots' rounding
    raws = [random_blocks(T.Q4_K, 16, k, seed=6), random_blocks(T.Q8_0, 8, k, seed=7)]
    mixed = panel_weight(compiled, raws, [T.Q4_K, T.Q8_0], k, gemm_min_rows=16)
    assert torch.equal(mixed.linear(x[:3], force_many_rows=True), mixed.linear(x[:3]))
    dots = compiled.GgufWeight([torch.from_numpy(r) for r in raws], [int(T.Q4_K), int(T.Q8_0)],
                               k)
    assert torch.equal(mixed.linear(x[:3], force_many_rows=True), dots.linear(x[:3]))


@needs_kernels
@pytest.mark.parametrize("rows", [3, 40])
def test_mixed_shards_take_panels_tiles_and_dots_by_rows(compiled, rows):
    """q | k | v of Q4_K, Q6_K and Q8_0 (no panel form: fp32 tiles) with a bias: from
    gemm_min_rows rows on the first two take panels, below it every shard takes the integer
    dots, exactly as without panels."""
    k = 256
    types = [T.Q4_K, T.Q6_K, T.Q8_0]
    raws = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, (16, 9, 8)))]
    w = torch.from_numpy(np.concatenate([reference_weight(r, t) for r, t in zip(raws, types)]))
    bias = torch.randn(33)
    x = uneven_activations(rows, k, seed=rows)
    weight = panel_weight(compiled, raws, types, k, gemm_min_rows=32)
    y = weight.linear(x, bias).double()
    if rows < 32:
        dots = compiled.GgufWeight([torch.from_numpy(r) for r in raws], [int(t) for t in types],
                                   k)
        assert torch.equal(y.float(), dots.linear(x, bias))
        return
    x_q, _ = rounded_activations(x)
    quantized = x_q @ w[:25].T + bias[:25].double()
    assert ((y[:, :25] - quantized).abs() <= 1e-5 * (x_q.abs() @ w[:25].abs().T) + 1e-6).all()
    exact = x.double() @ w[25:].T + bias[25:].double()          # Q8_0 on fp32 tiles
    assert ((y[:, 25:] - exact).abs() <= 1e-5 * (x.double().abs() @ w[25:].abs().T) + 1e-6).all()


@needs_kernels
def test_q8_0_and_float_shards_have_no_panel_form(compiled):
    """int8 panels do not change a projection whose shards have no panel form (Q8_0's 8-bit
    codes would overflow maddubs' int16 pair sums): it takes the fp32 tiles bit for bit."""
    k = 256
    for qtype in (T.Q8_0, T.F16):
        raw = torch.from_numpy(random_blocks(qtype, 20, k, seed=1))
        x = torch.randn(50, k)
        tiles = compiled.GgufWeight([raw], [int(qtype)], k, gemm_min_rows=1)
        assert torch.equal(panel_weight(compiled, [raw.numpy()], [qtype], k).linear(x),
                           tiles.linear(x))


@needs_kernels
@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=lambda t: t.name)
def test_every_int8_dot_gives_the_maddubs_panels_bit_for_bit(compiled, qtype):
    """The panel tiles on VNNI's vpdpbusd (where this CPU has it) sum each group's products
    straight into int32; maddubs sums them in int16 first. The same integers either way, so
    the same outputs: a prefill's numbers do not depend on the instruction."""
    from kvforge.kernels.ops import INT8_DOTS
    dots = vnni_dots(compiled)
    if not dots:
        pytest.skip("this CPU has no VNNI: the panels run maddubs alone")
    k = 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 608
    raw = torch.from_numpy(random_blocks(qtype, 29, k, seed=17 + int(qtype)))
    x = uneven_activations(37, k, seed=4)

    def panels(dot):
        return compiled.GgufWeight([raw], [int(qtype)], k, gemm_min_rows=1, int8_panels=True,
                                   int8_dot=dot).linear(x)

    maddubs = panels(INT8_DOTS["maddubs"])
    for code in dots:
        assert torch.equal(panels(code), maddubs)
