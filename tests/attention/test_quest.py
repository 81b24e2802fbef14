"""QUEST backend: bounds metadata, block selection vs brute force, sparse decode vs a dense
reference over the chosen blocks, and full budget == dense through the engine."""
from __future__ import annotations

import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend
from kvforge.attention.quest import (QuestAttentionBackend, block_bounds, key_bounds, kv_slots,
                                    select_blocks)
from tests.attention.paged_cases import PagedCase, make_case

DT = torch.float64


# ------------------------------------------------------------------ factories
def quest_backend(case: PagedCase, budget: int) -> QuestAttentionBackend:
    backend = QuestAttentionBackend(case.q.shape[1], case.k_new.shape[1], case.q.shape[2],
                                    case.scale)
    backend.token_budget = budget
    return backend


def noisy_quest_cache(case: PagedCase, seed: int = 1) -> torch.Tensor:
    """[2, NB, KVH * (B + 1), D] filled with loud noise, bounds rows included (stale values)."""
    gen = torch.Generator().manual_seed(seed)
    _, nb, size, kvh, d = case.kv_cache.shape
    return 100 * torch.randn(2, nb, kvh * (size + 1), d, generator=gen, dtype=DT)


def assert_bounds(cache: torch.Tensor, block: int, lo: torch.Tensor, hi: torch.Tensor) -> None:
    key_min, key_max = key_bounds(cache, lo.shape[0])
    assert torch.equal(key_min[block], lo) and torch.equal(key_max[block], hi), block


def prefill_contexts(backend, cache, case: PagedCase, chunk: int) -> None:
    """Write every sequence's context through the backend, ``chunk`` tokens per step."""
    for s, ctx in enumerate(case.context_lens):
        for start in range(0, ctx, chunk):
            end = min(ctx, start + chunk)
            meta = AttentionMetadata.build([end - start], [start], [case.block_tables[s]],
                                           case.block_size)
            q = torch.randn(end - start, backend.num_heads, backend.head_size, dtype=DT)
            backend.forward(q, case.k_full[s][start:end], case.v_full[s][start:end], cache, meta)


def expected_bounds(case: PagedCase, seq: int, num_tokens: int):
    """{block id: (min, max)} from the sequence's first num_tokens keys, computed directly."""
    out = {}
    size = case.block_size
    for j in range(-(-num_tokens // size)):
        keys = case.k_full[seq][j * size:min(num_tokens, (j + 1) * size)]
        out[case.block_tables[seq][j]] = (keys.amin(0), keys.amax(0))
    return out


def brute_force_choice(case: PagedCase, seq: int, query: torch.Tensor, num_tokens: int,
                       k: int) -> list[set[int]]:
    """Per KV head: the logical blocks with the k largest bounds, the last block forced in.

    query [H, D]; bound(block, h) = sum_d max(q_d min_d, q_d max_d), summed over h's group."""
    size = case.block_size
    num_blocks = -(-num_tokens // size)
    kvh = case.k_new.shape[1]
    group = query.shape[0] // kvh
    choice = []
    for g in range(kvh):
        scores = []
        for j in range(num_blocks):
            keys = case.k_full[seq][j * size:min(num_tokens, (j + 1) * size), g]
            lo, hi = keys.amin(0), keys.amax(0)
            total = 0.0
            for h in range(g * group, (g + 1) * group):
                total += float(torch.maximum(query[h] * lo, query[h] * hi).sum())
            scores.append(total)
        scores[-1] = float("inf")
        ranked = sorted(range(num_blocks), key=lambda j: -scores[j])
        choice.append(set(ranked[:k]))
    return choice


def attention_over_blocks(case: PagedCase, seq: int, query: torch.Tensor, num_tokens: int,
                          choice: list[set[int]]) -> torch.Tensor:
    """Dense softmax attention of each query head over its KV head's chosen blocks only."""
    size = case.block_size
    kvh = case.k_new.shape[1]
    group = query.shape[0] // kvh
    out = torch.empty(query.shape[0], case.v_full[seq].shape[-1], dtype=DT)
    for h in range(query.shape[0]):
        g = h // group
        pos = [p for j in sorted(choice[g]) for p in range(j * size, (j + 1) * size)
               if p < num_tokens]
        keys, values = case.k_full[seq][pos, g], case.v_full[seq][pos, g]
        probs = torch.softmax((keys @ query[h]) * case.scale, dim=0)
        out[h] = probs @ values
    return out


# ------------------------------------------------------------------ bounds metadata
@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
def test_bounds_exact_after_chunked_prefill_and_appends(chunk):
    case = make_case([1, 1], [22, 13], block_size=4, seed=3)
    backend = quest_backend(case, budget=8)
    cache = noisy_quest_cache(case)
    prefill_contexts(backend, cache, case, chunk)
    for s, ctx in enumerate(case.context_lens):
        for block, (lo, hi) in expected_bounds(case, s, ctx).items():
            assert_bounds(cache, block, lo, hi)
    # one decode step appends a token to each sequence; bounds follow it
    backend.forward(case.q, case.k_new, case.v_new, cache, case.meta())
    for s, ctx in enumerate(case.context_lens):
        for block, (lo, hi) in expected_bounds(case, s, ctx + 1).items():
            assert_bounds(cache, block, lo, hi)


def test_bounds_restart_when_a_freed_block_is_reused():
    # sequence 0 fills blocks with 10 tokens; then the same physical blocks go to a new sequence
    # in a different order that writes only 6 tokens: the bounds must forget the old keys and
    # the stale slots past the new tokens
    size, kvh, d = 4, 3, 16
    gen = torch.Generator().manual_seed(5)
    backend = QuestAttentionBackend(9, kvh, d, d ** -0.5)
    cache = torch.zeros(backend.kv_cache_shape(6, size), dtype=DT)
    old_k = 50 * torch.randn(10, kvh, d, generator=gen, dtype=DT)
    meta = AttentionMetadata.build([10], [0], [[2, 4, 5]], size)
    backend.forward(torch.randn(10, 9, d, dtype=DT), old_k, old_k.clone(), cache, meta)
    new_k = torch.randn(6, kvh, d, generator=gen, dtype=DT)
    meta = AttentionMetadata.build([6], [0], [[5, 2]], size)
    backend.forward(torch.randn(6, 9, d, dtype=DT), new_k, new_k.clone(), cache, meta)
    assert_bounds(cache, 5, new_k[:4].amin(0), new_k[:4].amax(0))
    assert_bounds(cache, 2, new_k[4:6].amin(0), new_k[4:6].amax(0))    # old slots 2, 3 excluded


def test_block_copy_carries_bounds():
    # the runner's copy-on-write copies cache[:, dst] = cache[:, src]; the bounds row goes along
    case = make_case([1], [7], block_size=4, seed=2)
    backend = quest_backend(case, budget=4)
    cache = noisy_quest_cache(case)
    prefill_contexts(backend, cache, case, chunk=7)
    src = case.block_tables[0][1]
    dst = next(b for b in range(cache.shape[1]) if b not in case.block_tables[0])
    cache[:, dst] = cache[:, src]
    table = [case.block_tables[0][0], dst]
    meta = AttentionMetadata.build([1], [7], [table], 4)
    backend.forward(case.q, case.k_new, case.v_new, cache, meta)
    keys = case.k_full[0][4:8]
    assert_bounds(cache, dst, keys.amin(0), keys.amax(0))


# ------------------------------------------------------------------ selection
@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (4, 4)])
def test_selection_equals_brute_force(heads):
    num_heads, num_kv_heads = heads
    case = make_case([1, 1, 1], [37, 9, 60], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     block_size=4, seed=11)
    backend = quest_backend(case, budget=16)
    cache = noisy_quest_cache(case)
    prefill_contexts(backend, cache, case, chunk=13)
    backend.forward(case.q, case.k_new, case.v_new, cache, case.meta())   # writes the new token
    meta = case.meta()
    n, size = 3, 4
    max_blocks = -(-max(meta.seq_lens_list) // size)
    table = meta.block_tables[:, :max_blocks]
    queries = case.q.view(n, num_kv_heads, num_heads // num_kv_heads, -1)
    key_min, key_max = key_bounds(cache, num_kv_heads)
    bounds = block_bounds(queries, key_min[table], key_max[table])
    chosen = select_blocks(bounds, (meta.seq_lens + size - 1) // size, 4)
    for s in range(n):
        seq_len = meta.seq_lens_list[s]
        want = brute_force_choice(case, s, case.q[s], seq_len, 4)
        num_blocks = -(-seq_len // size)
        for g in range(num_kv_heads):
            got = {j for j in chosen[s, g].tolist() if j < num_blocks}
            assert got == want[g], (s, g)
            assert num_blocks - 1 in got


@pytest.mark.parametrize("heads", [(9, 3), (4, 1)])
def test_sparse_decode_equals_attention_over_brute_force_blocks(heads):
    num_heads, num_kv_heads = heads
    # sequence 1 (10 tokens, 3 blocks) fits in the budget of 4 blocks: it is read whole
    case = make_case([1, 1, 1], [45, 9, 30], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     block_size=4, seed=4)
    backend = quest_backend(case, budget=16)
    cache = noisy_quest_cache(case)
    prefill_contexts(backend, cache, case, chunk=8)
    out = backend.forward(case.q, case.k_new, case.v_new, cache, case.meta())
    dense = case.reference()
    for s, ctx in enumerate(case.context_lens):
        choice = brute_force_choice(case, s, case.q[s], ctx + 1, 4)
        expected = attention_over_blocks(case, s, case.q[s], ctx + 1, choice)
        torch.testing.assert_close(out[s], expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out[1], dense[1], atol=1e-10, rtol=1e-10)
    assert not torch.allclose(out[0], dense[0]), "budget was meant to drop blocks of seq 0"


def test_budget_covering_context_equals_paged_exactly():
    case = make_case([1, 1, 5], [21, 3, 8], block_size=4, seed=6)
    quest = quest_backend(case, budget=24)
    cache = noisy_quest_cache(case)
    prefill_contexts(quest, cache, case, chunk=6)
    paged_cache = kv_slots(cache, 3).contiguous()
    out = quest.forward(case.q, case.k_new, case.v_new, cache, case.meta())
    paged = PagedAttentionBackend(9, 3, 16, case.scale)
    expected = paged.forward(case.q, case.k_new, case.v_new, paged_cache, case.meta())
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, case.reference(), atol=1e-10, rtol=1e-10)


def test_dense_layers_ignore_the_budget():
    case = make_case([1], [40], block_size=4, seed=8)
    backend = quest_backend(case, budget=8)
    backend.layer_idx, backend.dense_layers = 1, 2
    cache = noisy_quest_cache(case)
    prefill_contexts(backend, cache, case, chunk=40)
    out = backend.forward(case.q, case.k_new, case.v_new, cache, case.meta())
    torch.testing.assert_close(out, case.reference(), atol=1e-10, rtol=1e-10)


def test_rejects_a_paged_shaped_cache():
    case = make_case([1], [5], block_size=4)
    with pytest.raises(ValueError, match="quest kv_cache shape"):
        quest_backend(case, 8).forward(case.q, case.k_new, case.v_new, case.kv_cache, case.meta())


def test_bounds_in_a_bfloat16_cache_are_the_rounded_keys_extremes():
    case = make_case([1], [11], block_size=4, seed=9)
    backend = quest_backend(case, budget=4)
    cache = noisy_quest_cache(case).to(torch.bfloat16)
    prefill_contexts(backend, cache, case, chunk=5)
    for j, block in enumerate(case.block_tables[0][:3]):          # 11 tokens: 3 blocks
        keys = case.k_full[0][j * 4:min(11, j * 4 + 4)].to(torch.bfloat16)
        assert_bounds(cache, block, keys.amin(0), keys.amax(0))
