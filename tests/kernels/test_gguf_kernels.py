"""The GGUF block kernels (csrc/gguf_blocks.cpp) against gguf-py's numpy dequantization, once per
ISA build this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

from tests.kernels.test_cpu_kernels import compiled, needs_kernels  # noqa: F401 (fixture)

LEGACY = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]     # gguf-py quantizes these
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]                  # random but valid blocks
FLOATS = [T.F32, T.F16, T.BF16]
# byte offsets of each K-quant block's fp16 scales (the rest may be any bytes)
_K_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(qtype, n: int, k: int, seed: int = 0, scales=(1e-3, 1e-2)) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks: gguf-py's quantizer where it has one, else random
    bytes with sane fp16 scales (drawn from ``scales``)."""
    rng = np.random.default_rng(seed)
    if qtype in LEGACY or qtype in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return quants.quantize(w, qtype).view(np.uint8).reshape(n, -1)
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // block_weights, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(*scales, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference_weight(raw: np.ndarray, qtype) -> np.ndarray:
    return quants.dequantize(raw, qtype).astype(np.float64)


def activation_step(qtype) -> int:
    """Activations share an int8 step per 16 values for the 32-weight formats and per 256 (the
    super-block) for K-quants."""
    return 256 if qtype in K_QUANTS else 16


def activation_error_bound(x: torch.Tensor, w: np.ndarray, width: int = 16) -> torch.Tensor:
    """|x . w - x_q8 . w| <= sum_i |w_i| * d_b / 2 where d_b = max|x in block b| / 127 over
    blocks of ``width``: the kernel rounds each activation to the nearest multiple of its
    block's step."""
    step = x.double().abs().view(x.shape[0], -1, width).amax(-1) / 127       # [M, K/width]
    half_step = (step / 2).repeat_interleave(width, dim=1)                    # [M, K]
    wa = torch.from_numpy(np.abs(w))
    # + float rounding of the sums (fp32 accumulators)
    return half_step @ wa.T + 1e-5 * (x.double().abs() @ wa.T) + 1e-6


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS + FLOATS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_few_rows_within_activation_rounding(compiled, qtype, rows):
    assert rows <= compiled.gguf_dot_rows_max
    n, k = 37, 512
    raw = random_blocks(qtype, n, k, seed=int(qtype))
    w = reference_weight(raw, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    y = compiled.gguf_linear(x, [torch.from_numpy(raw)], [int(qtype)], None)
    ref = x.double() @ torch.from_numpy(w).T
    err = (y.double() - ref).abs()
    if qtype in FLOATS:      # float rows: fp32 dot products, no activation rounding
        assert err.max() <= 1e-5 * ref.abs().max() + 1e-6
    else:
        bound = activation_error_bound(x, w, activation_step(qtype))
        assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
        assert err.max() > 0          # the activations really are rounded (not a float path)


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
        bound = activation_error_bound(x, w, activation_step(qtype))
        assert ((y.double() - ref).abs() <= bound).all()
        for i in (0, 63, 64, 130):
            assert torch.equal(y[i:i + 1], compiled.gguf_linear(x[i:i + 1], [r], [int(qtype)],
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
    # the Q8_0 rows' activations have steps per 16, the K-quants' per 256 (the looser bound)
    assert ((y.double() - ref).abs() <= activation_error_bound(x, w, 256) + 1e-5).all()


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
    """The ISA's block kernels (codes decoded in registers, rows in groups of up to 4) do the
    portable kernel's integer arithmetic: equal up to the order of float sums, and a row of a
    group gets exactly what it gets alone."""
    n, k = 19, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=5 + int(qtype)))
    fast = compiled.GgufWeight([raw], [int(qtype)], k)
    portable = compiled.GgufWeight([raw], [int(qtype)], k, reference_kernels=True)
    weight_abs = torch.from_numpy(np.abs(reference_weight(raw.numpy(), qtype))).float()
    for rows in (1, 2, 3, 4, 5, 7, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        y = fast.linear(x)
        magnitude = (x.abs() @ weight_abs.T).max()
        assert (y - portable.linear(x)).abs().max() <= 2e-6 * magnitude
        alone = torch.cat([fast.linear(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(y, alone)
