"""The GGUF block kernels (csrc/gguf_blocks.cpp) against gguf-py's numpy dequantization, once per
ISA build this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from kvforge.kernels.gguf_tiles import synthetic_blocks
from kvforge.kernels.ops import INT8_DOTS
from tests.kernels.test_cpu_kernels import compiled, needs_kernels  # noqa: F401 (fixture)

LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]     # gguf-py quantizes these
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]                  # random but valid blocks
FLOATS = [T.F32, T.F16, T.BF16]


def random_blocks(qtype, n: int, k: int, seed: int = 0, scales=(1e-3, 1e-2)) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks (gguf_tiles.synthetic_blocks; floats by gguf-py)."""
    if qtype in (T.F32, T.F16, T.BF16):
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        return quants.quantize(w, qtype).view(np.uint8).reshape(n, -1)
    return synthetic_blocks(qtype.name, n, k, seed=seed, scales=scales)


def reference_weight(raw: np.ndarray, qtype) -> np.ndarray:
    return quants.dequantize(raw, qtype).astype(np.float64)


K_MAX_SHIFT = 4       # a K-quant 32-block's step is at most 16x finer than its super-block's


def activation_steps(x: torch.Tensor, qtype) -> torch.Tensor:
    """The int8 step of every activation [M, K] as the kernels choose it: per 16 values for the
    32-weight formats (max |x| / 127); for K-quants the super-block's max |x| / 127 divided by
    the largest power of two <= 16 that keeps each 32's values within +-127."""
    x = x.double().abs()
    if qtype not in K_QUANTS:
        return (x.view(x.shape[0], -1, 16).amax(-1) / 127).repeat_interleave(16, dim=1)
    block_max = x.view(x.shape[0], -1, 8, 32).amax(-1)                     # [M, K/256, 8]
    coarsest = block_max.amax(-1, keepdim=True) / 127
    e = torch.zeros_like(block_max)
    for _ in range(K_MAX_SHIFT):
        e += (block_max * 2 ** (e + 1) <= coarsest * 127).double()
    return (coarsest / 2 ** e).reshape(x.shape[0], -1).repeat_interleave(32, dim=1)


def activation_error_bound(x: torch.Tensor, w: np.ndarray, steps: torch.Tensor) -> torch.Tensor:
    """|x . w - x_q8 . w| <= sum_i |w_i| * step_i / 2: the kernel rounds each activation to the
    nearest multiple of its step."""
    wa = torch.from_numpy(np.abs(w))
    # + float rounding of the sums (fp32 accumulators)
    return (steps / 2) @ wa.T + 1e-5 * (x.double().abs() @ wa.T) + 1e-6


def uneven_activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows whose 32-blocks differ in scale by up to 2^6 (as channels with outliers do),
    so K-quant blocks take every shift."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** -torch.randint(0, 7, (rows, k // 32), generator=g).float()
    return torch.randn(rows, k, generator=g) * scale.repeat_interleave(32, dim=1)


@needs_kernels
@pytest.mark.parametrize("qtype,k", [(t, 512) for t in LEGACY + K_QUANTS + FLOATS]
                         + [(t, 608) for t in LEGACY], ids=lambda v: getattr(v, "name", f"K{v}"))
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_few_rows_within_activation_rounding(compiled, qtype, k, rows):
    """K = 608: 19 blocks of 32, i.e. the 32-weight kernels' groups of 4 blocks and a tail of
    3 taken one by one (K-quant rows are whole super-blocks of 256)."""
    assert rows <= compiled.gguf_dot_rows_max
    n = 37
    raw = random_blocks(qtype, n, k, seed=int(qtype))
    w = reference_weight(raw, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    y = compiled.gguf_linear(x, [torch.from_numpy(raw)], [int(qtype)], None)
    ref = x.double() @ torch.from_numpy(w).T
    err = (y.double() - ref).abs()
    if qtype in FLOATS:      # float rows: fp32 dot products, no activation rounding
        assert err.max() <= 1e-5 * ref.abs().max() + 1e-6
    else:
        bound = activation_error_bound(x, w, activation_steps(x, qtype))
        assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
        assert err.max() > 0          # the activations really are rounded (not a float path)


def k_quant_rounded(x: torch.Tensor, max_shift: int = K_MAX_SHIFT) -> torch.Tensor:
    """x [M, K] as the K-quant kernels round it, in float32 as they compute: q = round-half-even
    (x * 127 / max|x of the 256| * 2^e), times the step (max / 127) / 2^e."""
    v = x.float().view(x.shape[0], -1, 8, 32)
    block_max = v.abs().amax(-1, keepdim=True)
    amax = block_max.amax(-2, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    e = torch.zeros_like(block_max)
    for _ in range(max_shift):
        e += (block_max * 2 ** (e + 1) <= amax).float()
    q = torch.round(v * (inv * 2 ** e))
    return (q.double() * (amax / 127 / 2 ** e).double()).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_an_outlier_channel_coarsens_only_its_own_32_block(compiled, qtype):
    """One channel 300x the others (Qwen2's massive activations): a K-quant super-block's other
    32-blocks keep steps up to 16x finer than the outlier's. The kernel computes exactly the
    product of the weights with the activations rounded that way (up to float sums), and that
    is several times closer to the exact product than one step per 256."""
    n, k = 23, 512
    raw = random_blocks(qtype, n, k, seed=11 + int(qtype))
    w = torch.from_numpy(reference_weight(raw, qtype))
    x = uneven_activations(4, k, seed=2)
    x[:, 37] = 300.0
    y = compiled.gguf_linear(x, [torch.from_numpy(raw)], [int(qtype)], None).double()
    magnitude = (x.double().abs() @ w.abs().T).max()
    assert (y - k_quant_rounded(x) @ w.T).abs().max() <= 1e-5 * magnitude
    exact = x.double() @ w.T
    fine = (k_quant_rounded(x) @ w.T - exact).abs().mean()
    assert fine < (k_quant_rounded(x, max_shift=0) @ w.T - exact).abs().mean() / 4


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K])
def test_k_quant_rows_dequantize_to_gguf_pys_float32_bits(compiled, qtype):
    """Q4_K / Q6_K rows go to fp32 in registers (the prefill tiles' and embeddings' path): the
    same float32 products and sums as gguf-py's dequantizer, bit for bit."""
    raw = random_blocks(qtype, 33, 1024, seed=7)
    got = compiled.gguf_dequantize(torch.from_numpy(raw), int(qtype), 1024, None)
    expect = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), np.float32))
    assert torch.equal(got, expect.view(33, 1024))


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS + FLOATS, ids=lambda t: t.name)
def test_many_rows_and_dequantize_match_the_reference(compiled, qtype):
    """More rows than one pass of the dot kernels (a prefill chunk): block types run passes of
    integer dots, so each row gets exactly what it gets alone (prefill and decode agree); float
    types take fp32 tiles."""
    n, k = 70, 768 if qtype not in K_QUANTS else 512
    raw = random_blocks(qtype, n, k, seed=1 + int(qtype))
    w = reference_weight(raw, qtype)
    r = torch.from_numpy(raw)
    dense = compiled.gguf_dequantize(r, int(qtype), k, None)
    torch.testing.assert_close(dense.double(), torch.from_numpy(w), rtol=1e-6, atol=0)
    ids = torch.tensor([5, 0, 69, 5])
    torch.testing.assert_close(compiled.gguf_dequantize(r, int(qtype), k, ids), dense[ids],
                               rtol=0, atol=0)
    rows = 2 * compiled.gguf_dot_rows_max + 3                        # three passes
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    y = compiled.gguf_linear(x, [r], [int(qtype)], None)
    ref = x.double() @ torch.from_numpy(w).T
    if qtype in FLOATS:
        magnitude = x.double().abs() @ torch.from_numpy(np.abs(w)).T
        assert (y.double() - ref).abs().max() <= 1e-5 * magnitude.max()
    else:
        bound = activation_error_bound(x, w, activation_steps(x, qtype))
        assert ((y.double() - ref).abs() <= bound).all()
        for i in (0, 63, 64, 130):
            assert torch.equal(y[i:i + 1], compiled.gguf_linear(x[i:i + 1], [r], [int(qtype)],
                                                                None))
        for i in (1, 2, 3):            # each group of 4 rows gives a row its bits alone
            assert torch.equal(y[4:4 + i], compiled.gguf_linear(x[4:4 + i], [r], [int(qtype)],
                                                                 None))


@needs_kernels
@pytest.mark.parametrize("rows", [2, 65])
def test_shards_of_mixed_types_with_bias(compiled, rows):
    """q | k | v of different types (Q4_K_M files mix them) and a bias: one output."""
    k = 256
    types = [T.Q4_K, T.Q6_K, T.Q8_0]
    raws = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, (8, 4, 4)))]
    w = np.concatenate([reference_weight(r, t) for r, t in zip(raws, types)])
    bias = torch.randn(16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    y = compiled.gguf_linear(x, [torch.from_numpy(r) for r in raws], [int(t) for t in types],
                             bias)
    ref = x.double() @ torch.from_numpy(w).T + bias.double()
    steps = torch.cat([activation_steps(x, t).unsqueeze(0) for t in types]).amax(0)
    assert ((y.double() - ref).abs() <= activation_error_bound(x, w, steps) + 1e-5).all()


@needs_kernels
def test_reads_strided_raw_rows_in_place(compiled):
    """Raw rows with a stride (a view of a larger mapping) are read where they are."""
    raw = random_blocks(T.Q4_0, 12, 64)
    wide = np.zeros((12, raw.shape[1] + 5), dtype=np.uint8)
    wide[:, :raw.shape[1]] = raw
    view = torch.from_numpy(wide)[:, :raw.shape[1]]
    x = torch.randn(1, 64)
    torch.testing.assert_close(compiled.gguf_linear(x, [view], [int(T.Q4_0)], None),
                               compiled.gguf_linear(x, [torch.from_numpy(raw)], [int(T.Q4_0)],
                                                    None))


@needs_kernels
def test_unsupported_type_and_bad_rows_are_named(compiled):
    raw = torch.zeros(4, 84, dtype=torch.uint8)            # Q2_K: 84 bytes per 256 weights
    with pytest.raises(RuntimeError, match=r"GGML type id 10 has no native kernel"):
        compiled.gguf_linear(torch.randn(1, 256), [raw], [int(T.Q2_K)], None)
    with pytest.raises(RuntimeError, match=r"has 84 bytes per row; type id 2"):
        compiled.gguf_linear(torch.randn(1, 256), [raw], [int(T.Q4_0)], None)
    with pytest.raises(RuntimeError, match=r"row id 9 out of range"):
        compiled.gguf_dequantize(torch.zeros(4, 144, dtype=torch.uint8), int(T.Q4_0), 256,
                                 torch.tensor([9]))


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_simd_kernels_equal_the_portable_reference(compiled, qtype):
    """The ISA's block kernels (codes decoded in registers, rows in groups of up to 8, in either
    loop order: gguf_dot_kernels.inc) do the portable kernel's integer arithmetic: equal up to
    the order of float sums, and a row of a group gets exactly what it gets alone."""
    n, k = 19, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=5 + int(qtype)))
    fast = compiled.GgufWeight([raw], [int(qtype)], k)
    portable = compiled.GgufWeight([raw], [int(qtype)], k, reference_kernels=True)
    weight_abs = torch.from_numpy(np.abs(reference_weight(raw.numpy(), qtype))).float()
    for rows in (1, 2, 3, 4, 5, 7, 16):
        x = uneven_activations(rows, k, seed=rows)
        y = fast.linear(x)
        magnitude = (x.abs() @ weight_abs.T).max()
        assert (y - portable.linear(x)).abs().max() <= 2e-6 * magnitude
        alone = torch.cat([fast.linear(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(y, alone)



def vnni_dots(compiled) -> list[int]:
    """The VNNI int8 dots this CPU and build run (maddubs, on every AVX2 CPU, is what they are
    compared with)."""
    return [code for name, code in INT8_DOTS.items()
            if name != "maddubs" and compiled.int8_dot_supported(code)]


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_every_int8_dot_gives_the_maddubs_outputs_bit_for_bit(compiled, qtype):
    """The dot kernels on VNNI's vpdpbusd / vpdpwssd (where this CPU has them) compute the same
    int32 lanes as AVX2's maddubs + madd, so every output is the same float: a model's tokens
    do not depend on the machine's instruction. On a CPU without VNNI only maddubs runs, and
    the comparison with the portable reference still checks it."""
    n, k = 21, 768
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=11 + int(qtype)))
    maddubs = compiled.GgufWeight([raw], [int(qtype)], k, int8_dot=INT8_DOTS["maddubs"])
    portable = compiled.GgufWeight([raw], [int(qtype)], k, reference_kernels=True)
    weight_abs = torch.from_numpy(np.abs(reference_weight(raw.numpy(), qtype))).float()
    vnni = [compiled.GgufWeight([raw], [int(qtype)], k, int8_dot=code)
            for code in vnni_dots(compiled)]
    for rows in (1, 2, 3, 4, 6, 9):
        x = uneven_activations(rows, k, seed=100 + rows)
        y = maddubs.linear(x)
        assert (y - portable.linear(x)).abs().max() <= 2e-6 * (x.abs() @ weight_abs.T).max()
        for weight in vnni:
            assert torch.equal(weight.linear(x), y)


@needs_kernels
def test_an_int8_dot_the_cpu_lacks_is_refused(compiled):
    raw = torch.from_numpy(random_blocks(T.Q4_K, 4, 256))
    with pytest.raises(RuntimeError, match=r"int8 dot 7 is not one this CPU and build have"):
        compiled.GgufWeight([raw], [int(T.Q4_K)], 256, int8_dot=7)
    for code in INT8_DOTS.values():
        if not compiled.int8_dot_supported(code):
            with pytest.raises(RuntimeError, match=rf"int8 dot {code} is not one"):
                compiled.GgufWeight([raw], [int(T.Q4_K)], 256, int8_dot=code)
