"""Attention windows: the mask / position / block arithmetic against brute force, and the
windowed backend against a literal StreamingLLM reference (keys rotated at in-cache positions)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend
from kvforge.attention.window import AttentionWindow
from kvforge.attention.windowed import WindowedAttentionBackend, rotate_half_layout
from kvforge.kvcache.kv_manager import NULL_BLOCK
from kvforge.layers.rotary import RotaryEmbedding, compute_inv_freq
from kvforge.layers.rotary_unbounded import UnboundedRotaryEmbedding

H, KVH, D, B = 4, 2, 16, 4
WINDOWS = [AttentionWindow(s, w, mode) for s, w, mode in
           [(0, 1, "true"), (0, 5, "true"), (2, 3, "in_cache"), (4, 8, "in_cache"),
            (5, 4, "in_cache"), (1, 16, "in_cache"), (3, 6, "true")]]


# ----------------------------------------------------------------------------- arithmetic
def brute_visible(w: AttentionWindow, p: int, k: int) -> bool:
    if k > p:
        return False
    in_window = p - w.window < k          # the last `window` positions up to p: p-W+1 .. p
    return k < w.sinks or in_window


@pytest.mark.parametrize("w", WINDOWS, ids=str)
def test_visible_matches_brute_force(w):
    pos = torch.arange(40)
    mask = w.visible(pos[:, None], pos[None, :])
    expected = torch.tensor([[brute_visible(w, p, k) for k in range(40)] for p in range(40)])
    assert torch.equal(mask, expected)
    # every query sees itself and at most S + W keys
    assert mask.diagonal().all() and int(mask.sum(1).max()) <= w.span


@pytest.mark.parametrize("w", [w for w in WINDOWS if w.positions == "in_cache"], ids=str)
def test_sink_shift_is_streamingllm_in_cache_position(w):
    # in-cache position of the query c(p): its index in the list of cached keys it can see
    for p in range(60):
        cached = [k for k in range(p + 1) if brute_visible(w, p, k)]
        c_p = cached.index(p)
        assert int(w.sink_shift(torch.tensor(p))) == p - c_p == w.max_sink_shift(p)
        # window keys keep their true distance in the cache: consecutive after the sinks
        window_keys = [k for k in cached if k >= w.sinks]
        assert all(c_p - cached.index(k) == p - k for k in window_keys)
    assert int(AttentionWindow(4, 8, "true").sink_shift(torch.tensor(100))) == 0


@pytest.mark.parametrize("w", WINDOWS, ids=str)
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_dead_blocks_are_exactly_the_blocks_no_future_query_sees(w, block_size):
    horizon = 80
    for next_pos in range(60):
        dead = w.dead_blocks(next_pos, block_size)
        for i in range(next_pos // block_size + 1):
            block = range(i * block_size, (i + 1) * block_size)
            seen = any(brute_visible(w, q, k) for q in range(next_pos, horizon) for k in block)
            assert (i in dead) == (not seen), (next_pos, i, dead)


@pytest.mark.parametrize("w", WINDOWS, ids=str)
@pytest.mark.parametrize("num_new", [1, 3, 9])
def test_max_live_blocks_bounds_every_position_and_is_reached(w, num_new):
    def live(first_pos: int) -> int:
        end = -(-(first_pos + num_new) // B)
        return end - len([i for i in w.dead_blocks(first_pos, B) if i < end])

    worst = max(live(p) for p in range(200))
    assert worst <= w.max_live_blocks(B, num_new) <= worst + w.num_sink_blocks(B)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sinks=-1, window=4), "sinks must be an integer >= 0"),
    (dict(sinks=0, window=0), "window must be an integer >= 1"),
    (dict(sinks=True, window=4), "sinks must be an integer"),
    (dict(sinks=0, window=4.0), "window must be an integer"),
    (dict(sinks=0, window=4, positions="absolute"), "positions must be one of"),
])
def test_bad_window_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionWindow(**kwargs)


# ----------------------------------------------------------------------------- backend
def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    return rotate_half_layout(x, pos, inv_freq)


def streaming_reference(raw_q, raw_k, v, p: int, w: AttentionWindow, inv_freq, scale):
    """One query of one sequence the StreamingLLM way: the visible keys are re-indexed 0..n-1
    (in-cache positions, with "true" positions each key keeps its own), un-rotated q and k
    rotated at those positions, plain softmax. raw_q [H, D], raw_k / v [p + 1, KVH, D]."""
    keys = [k for k in range(p + 1) if brute_visible(w, p, k)]
    if w.positions == "in_cache":
        key_pos, q_pos = torch.arange(len(keys)), len(keys) - 1
    else:
        key_pos, q_pos = torch.tensor(keys), p
    k_rot = _rope(raw_k[keys], key_pos, inv_freq)                       # [n, KVH, D]
    q_rot = _rope(raw_q[None], torch.tensor([q_pos]), inv_freq)[0]      # [H, D]
    group = H // KVH
    out = []
    for h in range(H):
        scores = (k_rot[:, h // group] @ q_rot[h]) * scale
        out.append(torch.softmax(scores, 0) @ v[keys, h // group])
    return torch.stack(out)


def _make_case(w: AttentionWindow, query_lens, context_lens, free_dead: bool, seed=0):
    """Random un-rotated q/k/v per sequence, the cache filled with the context keys rotated at
    their true positions (as the model writes them), block tables of scattered blocks; with
    ``free_dead`` the dead blocks' table entries become NULL_BLOCK and their slots garbage."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq, _ = compute_inv_freq(D, 10000.0)
    seqs, tables, num_blocks = [], [], 0
    for q_len, ctx in zip(query_lens, context_lens):
        n = ctx + q_len
        seqs.append(dict(q=torch.randn(n, H, D, generator=gen, dtype=torch.float64),
                         k=torch.randn(n, KVH, D, generator=gen, dtype=torch.float64),
                         v=torch.randn(n, KVH, D, generator=gen, dtype=torch.float64)))
        nb = -(-n // B)
        tables.append(list(range(num_blocks + nb - 1, num_blocks - 1, -1)))   # reversed ids
        num_blocks += nb
    cache = torch.randn(2, num_blocks, B, KVH, D, generator=gen, dtype=torch.float64)
    for s, (table, ctx) in enumerate(zip(tables, context_lens)):
        k_rot = _rope(seqs[s]["k"][:ctx], torch.arange(ctx), inv_freq)
        for pos in range(ctx):
            cache[0, table[pos // B], pos % B] = k_rot[pos]
            cache[1, table[pos // B], pos % B] = seqs[s]["v"][pos]
        if free_dead:
            for i in w.dead_blocks(ctx, B):
                cache[:, table[i]] = float("nan")        # any read of a freed block shows
                table[i] = NULL_BLOCK
    q = torch.cat([_rope(sq["q"][c:], torch.arange(c, c + ql), inv_freq)
                   for sq, c, ql in zip(seqs, context_lens, query_lens)])
    k = torch.cat([_rope(sq["k"][c:], torch.arange(c, c + ql), inv_freq)
                   for sq, c, ql in zip(seqs, context_lens, query_lens)])
    v = torch.cat([sq["v"][c:] for sq, c in zip(seqs, context_lens)])
    return seqs, tables, cache, q, k, v, inv_freq


@pytest.mark.parametrize("w", [AttentionWindow(4, 8), AttentionWindow(3, 5),
                               AttentionWindow(0, 6, "true"), AttentionWindow(2, 7, "true")],
                         ids=str)
@pytest.mark.parametrize("free_dead", [False, True], ids=["all_blocks", "dead_freed"])
def test_backend_matches_streaming_reference(w, free_dead):
    # decodes first (short, at the window edge, far past it), then prefill chunks: a first
    # chunk, one with context crossing S + W, one far past it (several query tiles)
    query_lens, context_lens = [1, 1, 1, 1, 9, 7, 13], [2, 11, 40, 123, 0, 6, 70]
    seqs, tables, cache, q, k, v, inv_freq = _make_case(w, query_lens, context_lens, free_dead)
    backend = WindowedAttentionBackend(H, KVH, D, D ** -0.5)
    backend.window, backend.rope_inv_freq, backend.query_tile = w, inv_freq, 4
    meta = AttentionMetadata.build(query_lens, context_lens, tables, B)
    out = backend.forward(q, k, v, cache, meta)
    _assert_rows_match_reference(out, seqs, query_lens, context_lens, w, inv_freq)


def _query_rows(query_lens, context_lens):
    """(batch row, sequence, position) of every query, in batch order."""
    rows = [(s, p) for s, (ql, ctx) in enumerate(zip(query_lens, context_lens))
            for p in range(ctx, ctx + ql)]
    return [(row, s, p) for row, (s, p) in enumerate(rows)]


def _assert_rows_match_reference(out, seqs, query_lens, context_lens, w, inv_freq):
    for row, s, p in _query_rows(query_lens, context_lens):
        ref = streaming_reference(seqs[s]["q"][p], seqs[s]["k"], seqs[s]["v"], p, w,
                                  inv_freq, D ** -0.5)
        torch.testing.assert_close(out[row], ref, rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"seq {s} position {p}: {m}")


def test_sink_shift_changes_the_output_past_the_window():
    # true and in-cache positions agree up to position S + W - 1 and differ after it
    w_cache, w_true = AttentionWindow(4, 8), AttentionWindow(4, 8, "true")
    outs = []
    for w in (w_cache, w_true):
        seqs, tables, cache, q, k, v, inv_freq = _make_case(w_cache, [1, 1], [10, 30], False)
        backend = WindowedAttentionBackend(H, KVH, D, D ** -0.5)
        backend.window, backend.rope_inv_freq = w, inv_freq
        outs.append(backend.forward(q, k, v, cache, AttentionMetadata.build([1, 1], [10, 30],
                                                                            tables, B)))
    torch.testing.assert_close(outs[0][0], outs[1][0])        # position 10 <= S + W - 1 = 11
    assert (outs[0][1] - outs[1][1]).abs().max() > 1e-3      # position 30: sinks 19 closer


def test_window_larger_than_every_sequence_equals_paged():
    query_lens, context_lens = [1, 1, 7, 5], [9, 3, 0, 6]
    _, tables, cache, q, k, v, _ = _make_case(AttentionWindow(0, 64, "true"), query_lens,
                                              context_lens, False)
    cache2 = cache.clone()
    windowed = WindowedAttentionBackend(H, KVH, D, D ** -0.5)
    windowed.window = AttentionWindow(0, 64, "true")
    meta = AttentionMetadata.build(query_lens, context_lens, tables, B)
    expected = PagedAttentionBackend(H, KVH, D, D ** -0.5).forward(q, k, v, cache2, meta)
    torch.testing.assert_close(windowed.forward(q, k, v, cache, meta), expected)


def test_streaming_backend_without_rope_frequencies_raises():
    backend = WindowedAttentionBackend(H, KVH, D, D ** -0.5)
    backend.window = AttentionWindow(4, 8)
    meta = AttentionMetadata.build([1], [3], [[0]], B)
    with pytest.raises(ValueError, match="rope_inv_freq"):
        backend.forward(torch.zeros(1, H, D), torch.zeros(1, KVH, D), torch.zeros(1, KVH, D),
                        torch.zeros(2, 1, B, KVH, D), meta)


# ----------------------------------------------------------------------------- rotary
def test_unbounded_rotary_inside_table_is_the_table_and_past_it_is_relative():
    rotary = RotaryEmbedding(D, max_position=64, base=10000.0)
    inv_freq, _ = compute_inv_freq(D, 10000.0)
    unbounded = UnboundedRotaryEmbedding(rotary, inv_freq)
    inside = torch.tensor([0, 5, 63])
    for ours, table in zip(unbounded.cos_sin(inside), rotary.cos_sin(inside)):
        assert torch.equal(ours, table)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, D, generator=gen), torch.randn(1, 1, D, generator=gen)

    def score(qp: int, kp: int) -> float:
        (qc, qs), (kc, ks) = (unbounded.cos_sin(torch.tensor([x])) for x in (qp, kp))
        return float((unbounded.apply(q, qc, qs) * unbounded.apply(k, kc, ks)).sum())

    base = score(40, 33)
    # a mixed step (one position inside the table, one far past it) and huge offsets keep the
    # score a function of the distance only
    for offset in (100, 10**6, 10**9):
        assert math.isclose(score(40 + offset, 33 + offset), base, abs_tol=1e-4)
    cos, _ = unbounded.cos_sin(torch.tensor([3, 10**9]))
    assert torch.equal(cos[0], rotary.cos_sin(torch.tensor([3]))[0][0])


def test_rotate_half_layout_composes_and_inverts():
    inv_freq, _ = compute_inv_freq(D, 10000.0)
    x = torch.randn(3, H, D, dtype=torch.float64)
    pos = torch.tensor([5, 10**7, 123456789])
    back = rotate_half_layout(rotate_half_layout(x, pos, inv_freq), -pos, inv_freq)
    torch.testing.assert_close(back, x)
    two = rotate_half_layout(rotate_half_layout(x, pos, inv_freq), pos, inv_freq)
    torch.testing.assert_close(two, rotate_half_layout(x, 2 * pos, inv_freq))
    # it is the layout layers/rotary.py uses
    table = RotaryEmbedding(D, max_position=16, dtype=torch.float64)
    small = torch.tensor([0, 7, 15])
    cos, sin = table.cos_sin(small)
    torch.testing.assert_close(rotate_half_layout(x, small, inv_freq), table.apply(x, cos, sin),
                               rtol=1e-6, atol=1e-6)
    partial = RotaryEmbedding(D, rotary_dim=8, max_position=16, dtype=torch.float64)
    cos, sin = partial.cos_sin(small)
    torch.testing.assert_close(rotate_half_layout(x, small, compute_inv_freq(8, 10000.0)[0]),
                               partial.apply(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_windows_are_hashable_values():
    # the backend caches a step's plan per window: equal windows must share it
    assert len({AttentionWindow(4, 8), AttentionWindow(4, 8), AttentionWindow(4, 8, "true")}) == 2
    assert list(itertools.islice(AttentionWindow(0, 4).dead_blocks(100, 4), 1)) == [0]


@pytest.mark.parametrize("w", [AttentionWindow(0, 6, "true"), AttentionWindow(2, 7, "true"),
                               AttentionWindow(3, 5, "in_cache")], ids=str)
def test_window_over_quest_layout_matches_streaming_reference(w):
    """``windowed_quest`` (Gemma 3's local layers when QUEST is on): the same windows over
    QUEST's head-major cache. Decodes and prefill chunks against the reference, the step's K/V
    written at their head-major rows and their blocks' key bounds updated."""
    from kvforge.attention.quest import WindowedQuestBackend, key_bounds, kv_slots
    query_lens, context_lens = [1, 1, 1, 1, 9, 7, 13], [2, 11, 40, 123, 0, 6, 70]
    seqs, tables, paged, q, k, v, inv_freq = _make_case(w, query_lens, context_lens, False)
    num_blocks = paged.shape[1]
    cache = torch.randn(2, num_blocks, KVH * (B + 1), D, dtype=torch.float64)    # bounds: noise
    kv_slots(cache, KVH).copy_(paged)
    backend = WindowedQuestBackend(H, KVH, D, D ** -0.5)
    backend.window, backend.rope_inv_freq, backend.query_tile = w, inv_freq, 4
    assert backend.kv_cache_shape(num_blocks, B) == tuple(cache.shape)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, B)
    out = backend.forward(q, k, v, cache, meta)
    _assert_rows_match_reference(out, seqs, query_lens, context_lens, w, inv_freq)
    for row, s, p in _query_rows(query_lens, context_lens):
        torch.testing.assert_close(kv_slots(cache, KVH)[0, tables[s][p // B], p % B], k[row])
    key_min, key_max = key_bounds(cache, KVH)
    last = tables[3][(123 + 1 - 1) // B]           # seq 3's token 123 opened or joined a block
    filled = kv_slots(cache, KVH)[0, last, :123 % B + 1]
    assert torch.equal(key_min[last], filled.amin(0)) and torch.equal(key_max[last], filled.amax(0))
