"""Compiled CPU kernels (kvforge/kernels) against plain PyTorch references, and the engine's
greedy output with kernels on vs off."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvforge.kernels as kernels
from kvforge.kernels import ops
from kvforge.kernels.isa import supported_isas

needs_kernels = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                   reason="no C++ compiler on this machine")


# Every kernel test runs once per ISA build this CPU can execute (AVX2 and AVX-512 where both
# run); an ISA the CPU lacks is skipped with the reason, never silently passed.
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(
                  isa not in supported_isas(), reason=f"this CPU cannot run {isa} code"))
              for isa in (("avx2", "avx512") if "avx2" in supported_isas() else ("native",))]


@pytest.fixture(scope="module", params=ISA_PARAMS)
def compiled(request):
    """One ISA's kernel build, also the one ``ops`` and the engine use while the tests run."""
    module = kernels.cpu_kernels(request.param)
    assert module is not None, f"g++ is present but the {request.param} kernels failed to build"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_module", module)
        yield module


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(compiled, rows, with_residual):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    res = torch.randn(rows, 576, generator=g) if with_residual else None
    w = torch.randn(576, generator=g)
    y, total = compiled.add_rms_norm(x, res, w, 1e-5)
    ref_total = x + res if with_residual else x
    var = ref_total.double().pow(2).mean(-1, keepdim=True)
    ref = (ref_total.double() * torch.rsqrt(var + 1e-5) * w.double()).float()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, ref_total)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul_reads_strided_rows(compiled, rows):
    big = torch.randn(rows, 3072 + 7)
    gate_up = big[:, :3072]                    # row stride 3079: a view, not a copy
    out = compiled.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate_up[:, :1536]) * gate_up[:, 1536:])


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_matches_rotate_half(compiled, tokens):
    heads, dim = 12, 64
    qkv = torch.randn(tokens, heads * dim + 3 * dim)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)    # q|k view of a fused projection
    angle = torch.randn(tokens, dim // 2)
    c, s = angle.cos(), angle.sin()
    cos = torch.cat([c, c], -1)
    sin = torch.cat([-s, s], -1)
    out = ops.rotary_neox(x, cos[:, None], sin[:, None])
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    ref = torch.cat([x1 * c[:, None] - x2 * s[:, None], x2 * c[:, None] + x1 * s[:, None]], -1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 35, 64])
@pytest.mark.parametrize("shape", [(960, 576), (577, 1539), (5, 24)])   # tails: rows, tiles, lanes
def test_linear_rows(compiled, rows, shape):
    out_features, in_features = shape
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    y = compiled.linear_rows(x, w)
    ref = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_linear_rows_strided_rows_and_long_k(compiled):
    """Rows of x with a stride (a slice of a wider buffer) and K past the kernel's K block."""
    w = torch.randn(37, 4100)
    wide = torch.randn(10, 5000)
    x = wide[:, 7:4107]
    y = compiled.linear_rows(x, w)
    torch.testing.assert_close(y, (x.double() @ w.double().t()).float(), rtol=1e-4, atol=1e-3)


@needs_kernels
def test_linear_rows_rejects_bad_input(compiled):
    with pytest.raises(RuntimeError, match="at least one row"):
        compiled.linear_rows(torch.randn(0, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="shape"):
        compiled.linear_rows(torch.randn(2, 16), torch.randn(4, 15))
    with pytest.raises(RuntimeError, match="contiguous"):
        compiled.linear_rows(torch.randn(16, 2).t(), torch.randn(4, 16))


@needs_kernels
def test_linear_rows_dispatch_range(compiled):
    """ops.linear_rows takes LINEAR_ROWS_MIN..LINEAR_ROWS_MAX rows, the layer path MKL beyond."""
    w = torch.randn(8, 16)
    assert ops.linear_rows(torch.randn(ops.LINEAR_ROWS_MIN - 1, 16), w) is None
    assert ops.linear_rows(torch.randn(ops.LINEAR_ROWS_MAX + 1, 16), w) is None
    x = torch.randn(ops.LINEAR_ROWS_MIN, 16)
    torch.testing.assert_close(ops.linear_rows(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cols", [1, 5, 16, 47, 49152])
def test_argmax_rows_matches_torch(compiled, cols):
    """First index of the maximum (ties in lanes, blocks and the tail), -inf rows, and the
    first NaN, exactly as torch.argmax; strided rows."""
    g = torch.Generator().manual_seed(cols)
    wide = torch.randn(9, cols + 3, generator=g)
    x = wide[:, 1:1 + cols]
    x[1] = 0.5                                               # all equal: index 0
    x[2] = float("-inf")
    if cols > 3:
        x[3, [2, cols - 1]] = 9.0                            # a tie: the first wins
        x[4, [cols - 1, cols - 2]] = 9.0                     # a tie in the tail / last block
        x[5, 1] = float("nan")
        x[5, cols - 1] = float("nan")                        # the first NaN
        x[6, 0] = float("inf")
    if cols > 33:
        x[7, [17, 33]] = 9.0                                 # same lane, blocks 1 and 2
        x[8, [18, 33]] = 9.0                                 # other lanes: lower index wins
        x[0, [9, 25]] = 9.0                                  # same lane of 8: blocks 1 and 3
    assert torch.equal(compiled.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_last_dim(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_last_dim(x.double()), x.double().argmax(dim=-1))   # fallback


@needs_kernels
@pytest.mark.parametrize("shape", [(960, 576), (13, 32), (3, 16), (37, 4112)])  # pad, K blocks
def test_packed_layout_round_trip(compiled, shape):
    """packed[g, kb, j] = W[Rg + j, kb*L:(kb+1)*L], rows padded with zeros to a whole group
    (K-major panels, L = 1: R = 32 with AVX-512, 24 with AVX2)."""
    rows, lanes = ops.packed_layout()
    assert (rows, lanes) == (compiled.linear_pack_rows, compiled.linear_pack_lanes)
    assert (rows, lanes) in ((32, 1), (24, 1))
    w = torch.randn(*shape)
    p = ops.pack_linear_weight(w)
    groups = -(-shape[0] // rows)
    assert p.shape == (groups, shape[1] // lanes, rows, lanes) and p.is_contiguous()
    n, kb = shape[0] - 1, shape[1] // lanes - 1               # the last row's last k block
    assert torch.equal(p[n // rows, kb, n % rows], w[n, kb * lanes:(kb + 1) * lanes])
    assert not p.permute(0, 2, 1, 3).reshape(groups * rows, -1)[shape[0]:].any()    # padding
    assert torch.equal(ops.unpack_linear_weight(p, shape[0]), w)


@needs_kernels
def test_pack_refuses_what_the_kernel_cannot_take(compiled):
    _, lanes = ops.packed_layout()
    off_lanes = ops.pack_linear_weight(torch.randn(8, lanes + 1))
    assert (off_lanes is None) == (lanes > 1)             # K off the lanes (panels take any K)
    assert ops.pack_linear_weight(torch.randn(8, lanes, dtype=torch.float64)) is None
    assert ops.pack_linear_weight(torch.randn(8, lanes)) is not None


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 300])
@pytest.mark.parametrize("shape", [(960, 576), (13, 32), (37, 4112)])     # tails: groups, K blocks
def test_linear_packed_matches_reference(compiled, rows, shape):
    """The packed kernel against float64, and against the row-major kernel within a few ulps of
    the magnitudes summed (packing changes where W is read; tile shapes, and with them where the
    compiler fuses multiply-adds, may differ by ISA, so exact equality is not promised)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(*shape, generator=g)
    wide = torch.randn(rows, shape[1] + 8, generator=g)
    x = wide[:, 3:3 + shape[1]]                                   # strided rows
    y = compiled.linear_packed(x, ops.pack_linear_weight(w), shape[0])
    torch.testing.assert_close(y, (x.double() @ w.double().t()).float(), rtol=1e-4, atol=1e-3)
    if rows <= ops.LINEAR_ROWS_MAX:
        assert torch.equal(y, ops.linear_packed(x, ops.pack_linear_weight(w), shape[0]))
    magnitude = x.abs().double() @ w.abs().double().t()
    gap = (y.double() - compiled.linear_rows(x, w).double()).abs()
    assert (gap <= 16 * 2.0 ** -24 * magnitude).all(), gap.max()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 3, 13])
def test_linear_kernels_share_columns_between_threads(compiled, threads, rows):
    """Big enough weights run as a team: every thread streams its share of the columns in
    chunks and the first done takes chunks off the back of the others' shares (three threads on
    this two-core box get descheduled mid-share, so that path runs). Every column must be
    computed exactly once and the same way on any number of threads: float64 reference, and bit
    for bit the one-thread result. A bias on packed and row-major weights goes through the
    stack's path (test_tiny_models_decode_stack_matches_python_layers)."""
    g = torch.Generator().manual_seed(rows * 10 + threads)
    w = torch.randn(4001, 576, generator=g)               # 501 groups / tiles: a ragged end
    x = torch.randn(rows, 576, generator=g)
    packed = ops.pack_linear_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = (compiled.linear_packed(x, packed, 4001), compiled.linear_rows(x, w))
        torch.set_num_threads(threads)
        for _ in range(5):
            team = (compiled.linear_packed(x, packed, 4001), compiled.linear_rows(x, w))
            for y, y_alone in zip(team, alone):
                torch.testing.assert_close(y, (x.double() @ w.double().t()).float(), rtol=1e-4,
                                           atol=1e-3)
                assert torch.equal(y, y_alone)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_linear_packed_rejects_bad_input(compiled):
    p = ops.pack_linear_weight(torch.randn(20, 32))
    with pytest.raises(RuntimeError, match="packed weight must be"):
        compiled.linear_packed(torch.randn(2, 32), p, 20 + ops.packed_layout()[0])   # groups
    with pytest.raises(RuntimeError, match="packed weight must be"):
        compiled.linear_packed(torch.randn(2, 48), p, 20)            # K does not match
    with pytest.raises(RuntimeError, match="rows >= 1"):
        compiled.linear_packed(torch.randn(0, 32), p, 20)
    assert ops.linear_packed(torch.randn(ops.LINEAR_ROWS_MAX + 1, 32), p, 20) is None


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 300])       # the kernel, and MKL on an unpacked copy
def test_pack_linear_layer(compiled, rows, monkeypatch):
    from kvforge.layers.linear import (Linear, PackedLinearMethod, UnquantizedLinearMethod,
                                       dense_weight, pack_linear)
    layer = Linear(64, 40, bias=True)
    w, b = torch.randn(40, 64), torch.randn(40)
    layer.load_weight("weight", w)
    layer.load_weight("bias", b)
    x = torch.randn(2, rows, 64)
    before = layer(x)
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "0")            # packing forced off: row-major
    assert not pack_linear(layer) and type(layer.method) is UnquantizedLinearMethod
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "1")            # on, whatever this ISA prefers
    assert pack_linear(layer) and type(layer.method) is PackedLinearMethod
    assert not hasattr(layer, "weight") and pack_linear(layer)          # packed once
    assert torch.equal(dense_weight(layer), w)
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
    assert layer(x).shape == (2, rows, 40)
    with pytest.raises(ValueError, match="packed"):
        layer.load_weight("weight", w)
    odd = Linear(36, 8)                       # K = 36: off the vector lanes (panels take it)
    lanes = ops.packed_layout()[1]
    assert pack_linear(odd) == (36 % lanes == 0)
    assert (type(odd.method) is PackedLinearMethod) == (36 % lanes == 0)


@needs_kernels
@pytest.mark.parametrize("kv_heads,heads,block_size", [(3, 9, 16), (2, 2, 4), (1, 8, 8)])
def test_paged_decode_attention_matches_dense(compiled, kv_heads, heads, block_size):
    g = torch.Generator().manual_seed(heads * 100 + block_size)
    num_blocks, dim = 40, 32
    # a cache with an extra slot per block (QUEST's layout): the kernel must follow strides
    full = torch.randn(2, num_blocks, block_size + 1, kv_heads, dim, generator=g)
    key_cache, value_cache = full[0, :, :block_size], full[1, :, :block_size]
    seq_lens = torch.tensor([1, block_size, 3 * block_size + 1, 5])
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:4] for _ in range(4)])
    q = torch.randn(4, heads, dim, generator=g)
    out = compiled.paged_decode_attention(q, key_cache, value_cache, table, seq_lens, 0.3)
    group = heads // kv_heads
    for s, length in enumerate(seq_lens.tolist()):
        keys = key_cache[table[s]].reshape(-1, kv_heads, dim)[:length]
        values = value_cache[table[s]].reshape(-1, kv_heads, dim)[:length]
        ref = F.scaled_dot_product_attention(
            q[s][:, None], keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1), scale=0.3)[:, 0]
        torch.testing.assert_close(out[s], ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("lens,block_size,dim", [
    ([300], 16, 64),                  # batch 1: split into short chunks, merged
    ([1000, 37], 16, 24),             # dims off the 16-lane (AVX-512) path, on the 8-lane one
    ([300, 17], 16, 20),              # dims off both vector paths
    ([1000, 700, 5, 260, 999], 24, 64),   # 256-key chunks that start inside a 24-slot block
])
def test_paged_decode_attention_long_contexts(compiled, lens, block_size, dim):
    """Chunked (flash-decoding) decode attention over long paged contexts vs float64 math."""
    g = torch.Generator().manual_seed(sum(lens) + dim)
    kv_heads, heads = 3, 9
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_seq
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)
    table = torch.randperm(num_blocks, generator=g).view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, dim, generator=g)
    out = compiled.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens), 0.2)
    for s, length in enumerate(lens):
        keys = cache[0][table[s]].reshape(-1, kv_heads, dim)[:length].double()
        values = cache[1][table[s]].reshape(-1, kv_heads, dim)[:length].double()
        kv_of_head = torch.arange(heads) // (heads // kv_heads)
        scores = torch.einsum("hd,thd->ht", q[s].double(), keys[:, kv_of_head]) * 0.2
        ref = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:, kv_of_head])
        torch.testing.assert_close(out[s].double(), ref, rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens,window,block_size", [
    ([700], 512, 16),                 # first key 188: inside a block and a 256-key chunk
    ([300, 5, 1000, 64], 64, 24),     # short rows see everything, long ones their last 64
    ([257, 256, 255], 256, 16),       # windows that end one key past / at / before a chunk
    ([9], 1, 4),                      # a window of one key: the query's own
])
def test_paged_decode_attention_sliding_window(compiled, threads, lens, window, block_size):
    """window > 0: each row attends its last `window` keys (p - W < k <= p) straight from the
    paged cache, chunks at whole multiples of 256 positions, vs float64 math."""
    g = torch.Generator().manual_seed(sum(lens) + window + threads)
    kv_heads, heads, dim = 1, 4, 64
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_seq
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)
    table = torch.randperm(num_blocks, generator=g).view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = compiled.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens),
                                              0.125, window)
        full = compiled.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens),
                                               0.125)
    finally:
        torch.set_num_threads(before)
    for s, length in enumerate(lens):
        lo = max(0, length - window)
        keys = cache[0][table[s]].reshape(-1, dim)[lo:length].double()
        values = cache[1][table[s]].reshape(-1, dim)[lo:length].double()
        scores = q[s].double() @ keys.T * 0.125
        ref = scores.softmax(-1) @ values
        torch.testing.assert_close(out[s].double(), ref, rtol=1e-4, atol=1e-5)
        if length <= window:       # the window holds every key: the same bits as without one
            assert torch.equal(out[s], full[s])
        else:
            assert not torch.allclose(out[s], full[s])


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens,dim", [
    ([40], 64),                       # batch 1, one chunk: the heads split across threads
    ([1], 80),                        # one key; dims = one 4-vector run + one more vector
    ([5, 70], 24),                    # two sequences, dims off the 16-lane path
    ([300], 64),                      # chunks, no head split, merged
])
def test_paged_decode_attention_few_tasks(compiled, threads, lens, dim):
    """Few sequences with short contexts: (sequence, head range) tasks whose ranges cut GQA
    groups (9 heads over 3 KV heads, 4 ranges at 2 threads), normalised without a merge."""
    g = torch.Generator().manual_seed(sum(lens) * 7 + dim + threads)
    kv_heads, heads, block_size = 3, 9, 16
    per_seq = -(-max(lens) // block_size)
    num_blocks = 2 * len(lens) * per_seq
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:len(lens) * per_seq].view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = compiled.paged_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens),
                                              0.2)
    finally:
        torch.set_num_threads(before)
    kv_of_head = torch.arange(heads) // (heads // kv_heads)
    for s, length in enumerate(lens):
        keys = cache[0][table[s]].reshape(-1, kv_heads, dim)[:length].double()
        values = cache[1][table[s]].reshape(-1, kv_heads, dim)[:length].double()
        scores = torch.einsum("hd,thd->ht", q[s].double(), keys[:, kv_of_head]) * 0.2
        ref = torch.einsum("ht,thd->hd", scores.softmax(-1), values[:, kv_of_head])
        torch.testing.assert_close(out[s].double(), ref, rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("length", [40, 300, 600, 1000])
def test_paged_decode_attention_row_is_batch_invariant(compiled, threads, length):
    """A query row gives the same bits alone and beside any other rows: its chunks (and so its
    rounding) follow its own length, not the batch's. This is what makes speculative
    verification rows equal to decoding the same tokens one at a time."""
    g = torch.Generator().manual_seed(length + threads)
    kv_heads, heads, block_size, dim = 3, 9, 16, 64
    others = [[5], [length + 1, length + 2, length + 3], [1000] * 6, [17, 600]]
    per_seq = -(-1003 // block_size)
    rows = 1 + max(len(o) for o in others)
    cache = torch.randn(2, rows * per_seq, block_size, kv_heads, dim, generator=g)
    table = torch.randperm(rows * per_seq, generator=g).view(rows, per_seq)
    q = torch.randn(rows, heads, dim, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = compiled.paged_decode_attention(q[:1], cache[0], cache[1], table[:1],
                                                torch.tensor([length]), 0.2)
        for other in others:
            n = 1 + len(other)
            out = compiled.paged_decode_attention(q[:n], cache[0], cache[1], table[:n],
                                                  torch.tensor([length, *other]), 0.2)
            assert torch.equal(out[0], alone[0]), f"row of {length} keys beside {other}"
    finally:
        torch.set_num_threads(before)


def test_fallback_when_disabled(monkeypatch):
    """Kernels off (KVFORGE_KERNELS=0 or no compiler): the ops still compute the right thing."""
    monkeypatch.setattr(kernels, "_module", None)
    x, w = torch.randn(2, 8), torch.randn(8)
    y, total = ops.add_rms_norm(x, None, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), w, 1e-6))
    assert total is x
    assert ops.linear_rows(torch.randn(4, 8), torch.randn(3, 8)) is None
    gu = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_and_mul(gu), F.silu(gu[:, :5]) * gu[:, 5:])


def test_build_cache_keyed_by_checkout_and_sources(monkeypatch, tmp_path):
    """Two checkouts of the same sources get their own build directories (torch's build.ninja
    names absolute paths: a shared one would rebuild each time the other checkout loads it);
    the same checkout keeps one until a source changes."""
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    checkouts = []
    for name in ("a", "b"):
        csrc = tmp_path / name / "csrc"
        shutil.copytree(kernels._CSRC, csrc)
        checkouts.append(csrc)
    dirs = []
    for csrc in checkouts:
        monkeypatch.setattr(kernels, "_CSRC", csrc)
        dirs.append(kernels._build_dir("avx2"))
        assert kernels._build_dir("avx2") == dirs[-1]
    assert dirs[0] != dirs[1] and dirs[0].parent == tmp_path / "cache" / "kernels"
    assert kernels._build_dir("avx512") != dirs[1]                  # one build per ISA
    (checkouts[1] / "team.h").write_text((checkouts[1] / "team.h").read_text() + "\n// edited\n")
    assert kernels._build_dir("avx2") != dirs[1]


def test_a_killed_builders_lock_file_does_not_block_the_next_build(monkeypatch, tmp_path):
    """torch's build lock is a plain file a killed builder leaves behind (later loads would wait
    for it forever); build_kernels removes it under an flock the kernel releases on death."""
    import fcntl
    import torch.utils.cpp_extension as cpp_extension
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    stale = kernels._build_dir("avx2") / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    seen = {}

    def fake_load(name, build_directory, **_):
        seen["lock_left"] = (Path(build_directory) / "lock").exists()
        # while the build runs, another process cannot take the flock
        with open(Path(build_directory) / "kvforge.flock") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return name

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels.build_kernels("avx2") == "kvforge_cpu_kernels_avx2"
    assert seen == {"lock_left": False}


def _greedy(llm, prompts, max_tokens=24):
    from kvforge.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[max(lp.values()) for lp in o.outputs[0].logprobs] for o in outs])


def _kernels_off(llm, monkeypatch):
    """Plain PyTorch from here on: no fused ops, no compiled decode stack."""
    monkeypatch.setattr(kernels, "_module", None)
    model = llm.engine.runner.model
    monkeypatch.setattr(model, "_decode_stack", None, raising=False)
    monkeypatch.setattr(model, "_decode_stack_built", True, raising=False)


def _check_on_equals_off(llm, prompts, monkeypatch, atol, max_tokens=12):
    """Greedy tokens identical and logprobs within ``atol`` with kernels on (the stack must
    really run) and off; the engine stays clean."""
    on, on_lp = _greedy(llm, prompts, max_tokens=max_tokens)
    assert llm.engine.runner.model._decode_stack is not None
    with monkeypatch.context() as m:
        _kernels_off(llm, m)
        off, off_lp = _greedy(llm, prompts, max_tokens=max_tokens)
    assert on == off
    for a, b in zip(on_lp, off_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)
    llm.engine.check_integrity()


@needs_kernels
@pytest.mark.slow
def test_default_model_greedy_same_with_and_without_kernels(compiled, default_model_path,
                                                           monkeypatch):
    from kvforge import LLM
    # a model of its own: weights are packed for the build selected when they load (the shared
    # fixture's for this CPU's widest ISA, not for the one `compiled` selects here)
    smollm_llm = LLM(default_model_path, kv_cache_memory="256MiB", max_model_len=2048,
                     quantization="none")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
    on, on_lp = _greedy(smollm_llm, prompts)
    assert smollm_llm.engine.runner.model._decode_stack is not None   # the stack really ran
    _kernels_off(smollm_llm, monkeypatch)
    off, off_lp = _greedy(smollm_llm, prompts)
    assert on == off
    for a, b in zip(on_lp, off_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=2e-3)
    smollm_llm.engine.check_integrity()


@needs_kernels
@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("qwen2", {}),                                     # q/k/v biases
    ("llama", {"attention_bias": True, "num_key_value_heads": 4}),   # o_proj bias, MHA
])
def test_tiny_models_decode_stack_matches_python_layers(compiled, tiny_model_factory, monkeypatch,
                                                        kind, overrides):
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory(kind, **overrides)
    prompts = [[5, 17, 300, 42], [7] * 19, list(range(100, 140))]
    # batch sizes 3 (few-row tiles) and 12 (the large tiles)
    for batch in (prompts, prompts * 4):
        _check_on_equals_off(LLM(hf_dir, num_kv_blocks=64, block_size=4), batch, monkeypatch,
                             atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_stack_team_on_any_thread_count(compiled, tiny_model_factory, monkeypatch,
                                               threads):
    """The stack runs a step as one team of torch's threads: heads, KV heads and attention
    tasks split between them (4 heads / 2 KV heads over 3 threads leaves one thread no KV head),
    a 150-token context cut into chunks whose partial softmaxes merge inside the team, q/k/v
    biases added per claimed chunk. Same tokens and logprobs as the Python layers."""
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory("qwen2")
    prompts = [[5, 17, 300, 42], list(range(100, 250)), [7] * 19]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        llm = LLM(hf_dir, num_kv_blocks=128, block_size=4, num_threads=threads)
        _check_on_equals_off(llm, prompts, monkeypatch, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_stack_packs_what_it_can(compiled, tiny_model_factory, monkeypatch):
    """Building the stack packs the fp32 projections whose K fits the packed layout's lanes (the
    Python layers then run packed too) and leaves the others row-major: intermediate 36 keeps
    down_proj row-major for a layout whose lanes it misses (panels take any K); outputs equal the
    Python layers either way. Packing is forced on, as ``KVFORGE_PACKED_WEIGHTS=1`` does."""
    from kvforge.engine.llm import LLM
    from kvforge.layers.linear import PackedLinearMethod, UnquantizedLinearMethod
    hf_dir, _ = tiny_model_factory("llama", intermediate_size=36)
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "1")
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4)
    prompts = [[5, 17, 300, 42], [7] * 19, list(range(100, 140))]
    _check_on_equals_off(llm, prompts, monkeypatch, atol=1e-4)
    packed = PackedLinearMethod
    for layer in llm.engine.runner.model.model.layers:
        assert type(layer.self_attn.qkv_proj.method) is packed
        assert type(layer.mlp.gate_up_proj.method) is packed
        down = packed if 36 % ops.packed_layout()[1] == 0 else UnquantizedLinearMethod
        assert type(layer.mlp.down_proj.method) is down


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_packed_with_the_stack(compiled, tiny_model_factory, monkeypatch, tied):
    """The engine packs the LM head with the stack; a tied head's embedding table then reads its
    rows from the packed head (one copy). Same outputs as the Python path with kernels off."""
    from kvforge.engine.llm import LLM
    from kvforge.layers.linear import PackedLinearMethod, PackedRowsEmbedding
    hf_dir, hf_model = tiny_model_factory("llama", tie_word_embeddings=tied)
    table = hf_model.get_input_embeddings().weight.detach().float()
    monkeypatch.setenv(ops.PACKED_WEIGHTS_ENV, "1")       # the packed path, on any ISA
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4)
    model = llm.engine.runner.model
    assert type(model.lm_head.method) is PackedLinearMethod
    embed = model.model.embed_tokens
    assert isinstance(embed, PackedRowsEmbedding) == tied
    ids = torch.tensor([[0, 5, table.shape[0] - 1], [17, 17, 3]])
    torch.testing.assert_close(embed(ids), table[ids], rtol=0, atol=0)
    if tied:
        torch.testing.assert_close(embed.weight, table, rtol=0, atol=0)
        with pytest.raises(IndexError, match="out of range"):
            embed(torch.tensor([table.shape[0]]))
        with pytest.raises(IndexError, match="out of range"):
            embed(torch.tensor([-1]))
        with monkeypatch.context() as m:                     # the PyTorch path: same rows
            m.setattr(kernels, "_module", None)
            torch.testing.assert_close(embed(ids), table[ids], rtol=0, atol=0)
            with pytest.raises(IndexError, match="out of range"):
                embed(torch.tensor([-1]))
    _check_on_equals_off(llm, [[5, 17, 300, 42], [7] * 19], monkeypatch, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_stack_calls_back_quantized_projections(compiled, tiny_model_factory, monkeypatch,
                                                quantization):
    """Quantized projections run their own kernels from inside the stack: same greedy output and
    logprobs as the Python layers."""
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory("llama")
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4, quantization=quantization)
    prompts = [[5, 17, 300, 42], [7] * 19, list(range(100, 140))]
    _check_on_equals_off(llm, prompts, monkeypatch, atol=1e-3)


# ------------------------------------------------------------------ fp8 K/V (quant/fp8_kv.py)
FP8_KV = [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)]


@needs_kernels
@pytest.mark.parametrize("dtype,limit", FP8_KV, ids=["e4m3", "e5m2"])
def test_store_kv_rounds_as_torch_casts(compiled, dtype, limit):
    """The stack's K/V writes give the byte the Python backends write (clamp, then torch's
    cast): random floats over 8 decades, every fp8 value and every midpoint between two
    (ties to even), subnormals, zeros of both signs, the range's edges and beyond."""
    g = torch.Generator().manual_seed(0)
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-5, 1e-2, 1, 100, 1e4)]
                  + [values, (values[1:] + values[:-1]) / 2,
                     torch.tensor([0.0, -0.0, 1e-30, -1e-30, limit, -limit, 1e9, -1e9])])
    out = torch.empty(x.shape, dtype=dtype)
    compiled.store_kv(out, x)
    expected = x.clamp(-limit, limit).to(dtype)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    fp32 = torch.empty_like(x)
    compiled.store_kv(fp32, x)
    assert torch.equal(fp32, x)


@needs_kernels
@pytest.mark.parametrize("dtype", [d for d, _ in FP8_KV], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [0, 20])
def test_paged_decode_attention_reads_fp8_as_its_float_values(compiled, dtype, window):
    """Over fp8 caches the kernel computes what it computes over the same values in fp32, bit
    for bit (each block's rows converted exactly, then the fp32 loops): rows of 1 to 300 keys,
    chunks past 256, with and without a window."""
    g = torch.Generator().manual_seed(1)
    num_blocks, block, kv_heads, dim, heads = 48, 16, 3, 64, 9
    key_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=g) * 3).to(dtype)
    value_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=g) * 3).to(dtype)
    q = torch.randn(4, heads, dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:40].view(4, 10)
    tables = torch.cat([tables, torch.randperm(num_blocks, generator=g)[:32].view(4, 8)], 1)
    lens = torch.tensor([1, 17, 160, 288])
    out = compiled.paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125, window)
    ref = compiled.paged_decode_attention(q, key_cache.float(), value_cache.float(), tables,
                                          lens, 0.125, window)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="one dtype"):
        compiled.paged_decode_attention(q, key_cache, value_cache.float(), tables, lens, 0.125)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_decode_stack_matches_python_layers(compiled, tiny_model_factory, monkeypatch,
                                                   kv_dtype):
    """With an fp8 KV cache the stack runs the decode steps, several a call (its writes
    rounded as the Python backends round, its attention reading the fp8 blocks): the tokens
    and logprobs of the Python layers, one step at a time, over the same cache."""
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory("llama")
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4, kv_cache_dtype=kv_dtype)
    assert all(c.dtype != torch.float32 for c in llm.engine.runner.kv_caches)
    assert llm.engine.runner.supports_decode_steps
    prompts = [[5, 17, 300, 42], [7] * 19, list(range(100, 140))]
    _check_on_equals_off(llm, prompts, monkeypatch, atol=1e-4)


def test_decode_stack_not_built_for_other_backends(tiny_model_factory):
    """The tiled backend (no paged decode kernel of its own) is not one the stack runs."""
    from kvforge.engine.llm import LLM
    from kvforge.kernels.decode_stack import build_llama_decode_stack
    hf_dir, _ = tiny_model_factory("llama")
    llm = LLM(hf_dir, num_kv_blocks=16, block_size=16, attention_backend="tiled")
    assert build_llama_decode_stack(llm.engine.runner.model) is None


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("window", [(4, 16), (0, 16)])
def test_paged_decode_attention_with_sinks(compiled, threads, window):
    """Sinks + window: keys [0, S) scored with q_sink, (p - W, p] with q, one softmax; rows
    whose window reaches the sinks read every key; any thread count gives the reference."""
    sinks, width = window
    g = torch.Generator().manual_seed(sinks + width + threads)
    heads, kv_heads, dim, block = 6, 2, 32, 4
    lens = [9, 20, 21, 300, 17, 700]              # within S + W, at its edge, far past it
    per_seq = -(-max(lens) // block)
    tables = torch.randperm(len(lens) * per_seq, generator=g).view(len(lens), per_seq)
    k_cache = torch.randn(len(lens) * per_seq, block, kv_heads, dim, generator=g)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(lens), heads, dim, generator=g)
    q_sink = torch.randn(len(lens), heads, dim, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = compiled.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens),
                                              dim ** -0.5, width, sinks, q_sink)
    finally:
        torch.set_num_threads(before)
    group = heads // kv_heads
    for s, n in enumerate(lens):
        rows = tables[s, torch.arange(n) // block] * block + torch.arange(n) % block
        keys = k_cache.view(-1, kv_heads, dim)[rows].repeat_interleave(group, 1)    # [n, H, D]
        values = v_cache.view(-1, kv_heads, dim)[rows].repeat_interleave(group, 1)
        pos = torch.arange(n)
        sink = pos < sinks
        visible = sink | (pos > n - 1 - width)
        shifted = sink & (n - width > sinks)         # the window does not reach the sinks
        query = torch.where(shifted[:, None, None], q_sink[s][None], q[s][None])   # [n, H, D]
        scores = (query * keys).sum(-1) * dim ** -0.5                            # [n, H]
        weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(0)
        ref = (weights[..., None] * values).sum(0)
        torch.testing.assert_close(out[s], ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_streaming_decode_stack_matches_python_layers(compiled, tiny_model_factory, monkeypatch,
                                                      threads):
    """StreamingLLM (4 sinks, window 16, in-cache positions) through the compiled stack: past
    position S + W the sinks are scored with the query rotated at S + W - 1 and the blocks
    between sinks and window are freed; the Python layers' tokens and logprobs, one step at a
    time and in multi-step calls, past the model's 64-token context."""
    from kvforge.engine.llm import LLM
    from kvforge.sampling_params import SamplingParams
    hf_dir, _ = tiny_model_factory("llama", max_position_embeddings=64, initializer_range=0.1)
    prompts = [list(range(100, 140)), [5, 17, 300, 42] * 3, [7] * 19]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        llm = LLM(hf_dir, block_size=4, num_kv_blocks=64, num_threads=threads,
                  attention_sinks=4, sliding_window=16)
        stack = llm.engine.runner.model.decode_stack()
        assert stack is not None and stack.window == 16
        on, on_lp = _greedy(llm, prompts, max_tokens=60)          # to position 99
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        multi = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        with monkeypatch.context() as m:
            _kernels_off(llm, m)
            m.setattr(llm.engine.runner, "_stack_limit", None)
            off, off_lp = _greedy(llm, prompts, max_tokens=60)
        assert on == off == multi
        for a, b in zip(on_lp, off_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == 64
    finally:
        torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_quest_decode_stack_matches_python_layers(compiled, tiny_model_factory, monkeypatch,
                                                  threads):
    """QUEST through the compiled stack: the head-major cache, the bounds it writes and the
    top blocks of the sparse layers (budget 2 blocks of 4, the first layer dense) give the
    Python layers' tokens and logprobs (their sparse decodes through PyTorch, kernels off),
    one step at a time and in multi-step calls (no logprobs), on 1-3 threads (a team of 3
    leaves one thread no KV head); the stack took every decode (no Python sparse decode)."""
    from kvforge.engine.llm import LLM
    from kvforge.sampling_params import SamplingParams
    hf_dir, _ = tiny_model_factory("qwen2")
    prompts = [list(range(100, 150)), [5, 17, 300, 42] * 9, [7] * 19]   # 50, 36, 19 tokens
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        llm = LLM(hf_dir, num_kv_blocks=128, block_size=4, num_threads=threads,
                  sparse_attention="quest", sparse_token_budget=8, quest_dense_layers=1)
        stack = llm.engine.runner.model.decode_stack()
        assert stack is not None and stack.quest
        with monkeypatch.context() as m:
            from tests.helpers.engine_watch import spy_quest_sparse_decodes
            sparse_in_python = spy_quest_sparse_decodes(m)
            on, on_lp = _greedy(llm, prompts, max_tokens=12)
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            multi = [o.outputs[0].token_ids
                     for o in llm.generate(prompts, params, use_tqdm=False)]
            assert sparse_in_python == []
            _kernels_off(llm, m)
            off, off_lp = _greedy(llm, prompts, max_tokens=12)
            assert sparse_in_python and set(sparse_in_python) == {1}   # layer 0 is dense
        assert on == off == multi
        for a, b in zip(on_lp, off_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_quest_stack_selects_blocks(compiled, tiny_model_factory):
    """The stack's QUEST layers really attend to fewer blocks: with a budget of 2 blocks the
    logprobs move away from the dense stack's (budget above every context), which equals plain
    paged attention's."""
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory("qwen2")
    prompts = [list(range(100, 150)), [5, 17, 300, 42] * 9]
    runs = {}
    for name, options in (("paged", {}),
                          ("dense", {"sparse_attention": "quest", "sparse_token_budget": 4096}),
                          ("sparse", {"sparse_attention": "quest", "sparse_token_budget": 8,
                                      "quest_dense_layers": 0})):
        llm = LLM(hf_dir, num_kv_blocks=128, block_size=4, **options)
        runs[name] = _greedy(llm, prompts, max_tokens=8)[1]
        assert llm.engine.runner.model.decode_stack() is not None
    for a, b in zip(runs["dense"], runs["paged"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    gap = max(abs(x - y) for a, b in zip(runs["sparse"], runs["dense"]) for x, y in zip(a, b))
    assert gap > 1e-3


@needs_kernels
def test_stack_runs_short_prefills_and_verification_like_python_layers(compiled, tiny_model_factory,
                                                                        monkeypatch):
    """Query runs of several tokens per sequence (prompts <= 16 tokens, n-gram verification of
    k = 4 speculated tokens) take the stack's per-token causal path."""
    from kvforge.engine.llm import LLM
    hf_dir, _ = tiny_model_factory("qwen2")
    prompts = [[5, 17, 300, 42, 5, 17, 300], [9, 8, 7, 9, 8, 7, 9, 8], [3] * 12]
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4, speculative_method="ngram",
              num_speculative_tokens=4)
    seen = []
    model = llm.engine.runner.model
    original = type(model).forward

    def spy(self, input_ids, positions, kv_caches, meta):
        seen.append(max(meta.query_lens_list))
        return original(self, input_ids, positions, kv_caches, meta)

    with monkeypatch.context() as m:
        m.setattr(type(model), "forward", spy)
        _greedy(llm, prompts, max_tokens=16)
    assert max(seen) > 1                                   # multi-token runs happened
    _check_on_equals_off(llm, prompts, monkeypatch, atol=1e-4, max_tokens=16)
    # verification runs up to 8 rows a step, where row-major tiles are faster: not packed
    from kvforge.layers.linear import UnquantizedLinearMethod
    assert all(type(layer.self_attn.qkv_proj.method) is UnquantizedLinearMethod
               for layer in model.model.layers)


@needs_kernels
def test_row_major_tied_head_stays_the_embedding(compiled, tiny_model_factory, monkeypatch):
    """A speculating engine keeps row-major weights; moving them into huge pages must leave a
    tied LM head and the embedding table one tensor (same storage, same values as HF's)."""
    from kvforge.engine.llm import LLM
    from kvforge.layers.linear import UnquantizedLinearMethod
    hf_dir, hf_model = tiny_model_factory("llama", tie_word_embeddings=True)
    llm = LLM(hf_dir, num_kv_blocks=64, block_size=4, speculative_method="ngram",
              num_speculative_tokens=4)
    model = llm.engine.runner.model
    assert type(model.lm_head.method) is UnquantizedLinearMethod
    assert model.model.embed_tokens.weight is model.lm_head.weight
    table = hf_model.get_input_embeddings().weight.detach().float()
    torch.testing.assert_close(model.lm_head.weight, table, rtol=0, atol=0)
    _check_on_equals_off(llm, [[5, 17, 300, 42, 5, 17, 300], [3] * 12], monkeypatch, atol=1e-4,
                         max_tokens=8)


@needs_kernels
@pytest.mark.parametrize("budget_blocks", [1, 3, 6])
def test_quest_decode_kernel_matches_pytorch_path(compiled, monkeypatch, budget_blocks):
    """csrc/quest.cpp selects the same blocks (bounds from the stored key min/max, current
    block always) and attends like attention/quest.py's PyTorch path."""
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.attention.quest import QuestAttentionBackend, write_kv_and_bounds
    g = torch.Generator().manual_seed(budget_blocks)
    heads, kv_heads, dim, block = 6, 2, 32, 4
    backend = QuestAttentionBackend(heads, kv_heads, dim, dim ** -0.5)
    backend.token_budget = budget_blocks * block
    lens = [37, 50, 9, 45]                      # partial current blocks; one short sequence
    per_seq = -(-(max(lens) + 1) // block)
    perm = torch.randperm(len(lens) * per_seq, generator=g).tolist()
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(len(lens))]
    cache = torch.zeros(backend.kv_cache_shape(len(perm), block))
    k = torch.randn(sum(lens), kv_heads, dim, generator=g)
    write_kv_and_bounds(cache, k, torch.randn_like(k),
                        AttentionMetadata.build(lens, [0] * len(lens), tables, block))
    q = torch.randn(len(lens), heads, dim, generator=g)
    kn = torch.randn(len(lens), kv_heads, dim, generator=g)
    step = lambda: AttentionMetadata.build([1] * len(lens), lens, tables, block)  # noqa: E731
    with_kernel = backend.forward(q, kn, kn, cache.clone(), step())
    monkeypatch.setattr(kernels, "_module", None)
    reference = backend.forward(q, kn, kn, cache.clone(), step())
    torch.testing.assert_close(with_kernel, reference, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_quest_write_matches_write_kv_and_bounds(compiled):
    """K/V writes + block key min/max: chunked prefill, decodes, a rewrite of rolled-back slots
    and a reused block with stale slots past the written ones, against the PyTorch rule."""
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.attention.quest import write_kv_and_bounds
    g = torch.Generator().manual_seed(0)
    kv_heads, dim, block, num_blocks = 2, 16, 4, 12
    ours = torch.randn(2, num_blocks, kv_heads * (block + 1), dim, generator=g)  # stale garbage
    ref = ours.clone()
    steps = [([6, 3], [0, 0], [[0, 1], [5]]),          # prefill chunks of two sequences
             ([1, 1], [6, 3], [[0, 1], [5]]),          # decodes
             ([3], [5], [[0, 1]]),                     # rewrite positions 5..7 (rollback)
             ([2], [0], [[7]])]                        # a reused block: slots 2, 3 stale
    for query_lens, context_lens, tables in steps:
        meta = AttentionMetadata.build(query_lens, context_lens, tables, block)
        k = torch.randn(sum(query_lens), kv_heads, dim, generator=g)
        v = torch.randn_like(k)
        compiled.quest_write(ours, k, v, meta.slot_mapping)
        write_kv_and_bounds(ref, k, v, meta)
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_a_finished_build_is_imported_without_torchs_loader(tmp_path):
    """A build marked finished loads in a fresh process without torch's cpp_extension (and
    setuptools, ninja): ~0.1 s of every start. The marker names the library's size and mtime,
    so a library changed since (a rebuild in progress) or one that will not import goes back
    to torch's loader."""
    import json
    import subprocess
    import sys
    from kvforge.kernels.isa import selected_isa
    isa = selected_isa()                     # what the fresh process below selects too
    if kernels.cpu_kernels(isa) is None:     # built (and marked) by now
        pytest.skip("compiled kernels unavailable")
    code = ("import sys, torch; from kvforge.kernels import cpu_kernels; m = cpu_kernels(); "
            "print(m.__file__, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(kernels._build_dir(isa) / f"kvforge_cpu_kernels_{isa}.so"), "False"]
    name = "kvforge_cpu_kernels_fake"
    library = tmp_path / f"{name}.so"
    library.write_bytes(b"not a shared library")
    assert kernels._import_built(tmp_path, name) is None                   # no marker
    kernels._mark_built(tmp_path, name)
    marker = json.loads((tmp_path / kernels._BUILT_MARKER).read_text())
    assert marker["size"] == len(b"not a shared library")
    assert kernels._import_built(tmp_path, name) is None                   # will not import
    library.write_bytes(b"rebuilt, longer library")
    marker_now = json.loads((tmp_path / kernels._BUILT_MARKER).read_text())
    assert marker_now["size"] != library.stat().st_size                    # changed since
    assert kernels._import_built(tmp_path, name) is None
