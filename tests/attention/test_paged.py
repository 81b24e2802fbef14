"""PagedAttentionBackend against the dense float64 reference on random paged layouts."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kvforge.attention.paged as paged_mod
from kvforge.attention.base import get_backend_cls
from kvforge.attention.paged import PagedAttentionBackend, shifted_causal_mask
from kvforge.attention.reference import dense_causal_attention
from tests.attention.paged_cases import PagedCase, make_case

ATOL = 1e-5
HEAD_LAYOUTS = [(9, 3), (4, 1), (4, 4)]   # GQA, MQA, MHA


def run_backend(case: PagedCase, dtype=torch.float32, **attrs) -> tuple[torch.Tensor, torch.Tensor]:
    num_heads, num_kv_heads, head_size = case.q.shape[1], case.k_new.shape[1], case.q.shape[2]
    backend = PagedAttentionBackend(num_heads, num_kv_heads, head_size, case.scale)
    for name, value in attrs.items():
        setattr(backend, name, value)
    cache = case.kv_cache.to(dtype)
    out = backend.forward(case.q.to(dtype), case.k_new.to(dtype), case.v_new.to(dtype), cache,
                          case.meta())
    return out, cache


def random_batch(rng: random.Random) -> tuple[list[int], list[int]]:
    """Decodes (query 1) first, then prefill chunks, some with cached context (chunked prefill)."""
    num_decodes, num_prefills = rng.randint(0, 4), rng.randint(0, 3)
    if num_decodes + num_prefills == 0:
        num_decodes = 1
    query_lens = [1] * num_decodes + [rng.randint(2, 20) for _ in range(num_prefills)]
    context_lens = [rng.randint(0, 40) for _ in range(num_decodes)]
    context_lens += [rng.choice([0, rng.randint(1, 40)]) for _ in range(num_prefills)]
    return query_lens, context_lens


# ---------------------------------------------------------------- the reference itself
def test_reference_single_visible_key_returns_its_value():
    # a first token sees only itself: softmax over one key is 1, output is that value row
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 8, dtype=torch.float64)
    out = dense_causal_attention(q, k, v, 0.3, [1], [0])
    assert torch.equal(out[0, :2], v[0, [0, 0]]) and torch.equal(out[0, 2:], v[0, [1, 1]])


def test_reference_equal_scores_average_visible_values():
    # zero queries give equal scores: the output is the mean of the visible values only
    k = torch.randn(5, 1, 4, dtype=torch.float64)
    v = torch.randn(5, 1, 4, dtype=torch.float64)
    out = dense_causal_attention(torch.zeros(2, 2, 4, dtype=torch.float64), k, v, 1.0, [2], [3])
    torch.testing.assert_close(out[0, 1], v[:4, 0].mean(0))
    torch.testing.assert_close(out[1, 0], v[:5, 0].mean(0))


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
def test_reference_matches_torch_sdpa_with_repeated_heads(num_heads, num_kv_heads):
    # external oracle: SDPA (math) with K/V repeated per query head and a bottom-right causal mask
    ctx, q_len, d = 5, 7, 8
    q = torch.randn(q_len, num_heads, d, dtype=torch.float64)
    k = torch.randn(ctx + q_len, num_kv_heads, d, dtype=torch.float64)
    v = torch.randn(ctx + q_len, num_kv_heads, d, dtype=torch.float64)
    group = num_heads // num_kv_heads
    mask = torch.ones(q_len, ctx + q_len, dtype=torch.bool).tril(ctx)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=0.2).transpose(0, 1)
    torch.testing.assert_close(dense_causal_attention(q, k, v, 0.2, [q_len], [ctx]), expected)


def test_reference_rejects_inconsistent_lengths():
    q, kv = torch.zeros(3, 2, 4), torch.zeros(5, 1, 4)
    with pytest.raises(ValueError, match="sum\\(query_lens\\)"):
        dense_causal_attention(q, kv, kv, 1.0, [2], [3])
    with pytest.raises(ValueError, match="rows"):
        dense_causal_attention(q, kv, kv, 1.0, [3], [1])


def test_shifted_causal_mask_sketch():
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(shifted_causal_mask(2, 3, torch.device("cpu")), expected)


# ---------------------------------------------------------------- paged vs reference
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_batches_match_reference(num_heads, num_kv_heads, block_size, seed):
    rng = random.Random(hash((num_heads, num_kv_heads, block_size, seed)))
    query_lens, context_lens = random_batch(rng)
    case = make_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     block_size=block_size, seed=seed)
    out, _ = run_backend(case)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_decode_only_batch_with_varied_contexts():
    case = make_case([1] * 5, [0, 3, 17, 31, 8], block_size=4, seed=1)
    meta = case.meta()
    assert meta.num_decodes == 5 and meta.num_prefills == 0
    out, _ = run_backend(case)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_chunked_prefill_only_batch():
    # chunks that start mid-block and ones that start on a block boundary
    case = make_case([6, 9, 4], [5, 8, 0], block_size=4, seed=2)
    assert case.meta().num_decodes == 0
    out, _ = run_backend(case)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_single_token_chunk_after_a_prefill_takes_prefill_path():
    case = make_case([1, 5, 1], [6, 3, 9], block_size=4, seed=3)
    meta = case.meta()
    assert meta.num_decodes == 1 and meta.num_prefills == 2
    out, _ = run_backend(case)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_float64_backend_matches_reference_tightly():
    case = make_case([1, 1, 7, 3], [9, 0, 5, 0], block_size=4, seed=4, cache_dtype=torch.float64)
    out, _ = run_backend(case, dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, case.reference(), atol=1e-12, rtol=0)


def test_decode_slices_give_the_same_result():
    # a gather budget of one byte forces one sequence per slice, each with its own padding
    case = make_case([1] * 4 + [3], [2, 30, 9, 17, 4], block_size=4, seed=5)
    whole, _ = run_backend(case)
    sliced, _ = run_backend(case, decode_gather_bytes=1)
    torch.testing.assert_close(sliced.double(), case.reference(), atol=ATOL, rtol=0)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 1)])
def test_grouped_query_fallback_without_enable_gqa(monkeypatch, num_heads, num_kv_heads):
    monkeypatch.setattr(paged_mod, "_SDPA_HAS_GQA", False)
    case = make_case([1, 6, 5], [7, 0, 6], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     block_size=4, seed=6)
    out, _ = run_backend(case)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- cache contents
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cache_after_write_holds_scattered_input_and_nothing_else_changes(block_size):
    case = make_case([1, 1, 9, 4], [5, 0, 3, 20], block_size=block_size, seed=7)
    expected = case.expected_cache()
    assert not torch.equal(expected, case.kv_cache)   # the step does write something
    _, cache = run_backend(case)
    assert torch.equal(cache, expected)


def test_sequences_sharing_prefix_blocks_read_the_same_data():
    # block tables [a, b, c..] and [a, b, d..]: the physical prefix blocks are read by both
    for query_lens, context_lens in (([1, 1], [9, 11]), ([5, 3], [8, 10]), ([1, 4], [8, 9])):
        case = make_case(query_lens, context_lens, block_size=4, seed=8, shared_prefix_blocks=2)
        assert case.block_tables[0][:2] == case.block_tables[1][:2]
        assert case.block_tables[0][2:] != case.block_tables[1][2:]
        out, _ = run_backend(case)
        torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_identical_sequences_on_shared_blocks_give_identical_outputs():
    # two decodes whose whole context is the same shared block, same query: same output rows
    case = make_case([1, 1], [8, 8], block_size=4, seed=9, shared_prefix_blocks=2)
    case.q[1] = case.q[0]
    case.k_new[1], case.v_new[1] = case.k_new[0], case.v_new[0]
    case.k_full[1][8], case.v_full[1][8] = case.k_new[0], case.v_new[0]
    out, _ = run_backend(case)
    torch.testing.assert_close(out[0], out[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


# ---------------------------------------------------------------- contract
def test_registered_as_paged():
    assert get_backend_cls("paged") is PagedAttentionBackend
    backend = PagedAttentionBackend(9, 3, 64, 0.125)
    assert backend.kv_cache_shape(10, 16) == (2, 10, 16, 3, 64)


def test_output_shape_dtype_and_noncontiguous_inputs():
    # q/k/v as column slices of one fused projection, the way a model hands them over
    case = make_case([1, 4], [3, 2], num_heads=4, num_kv_heads=2, head_size=8, seed=10)
    fused = torch.cat([case.q.flatten(1), case.k_new.flatten(1), case.v_new.flatten(1)], 1).float()
    q, k, v = fused.split([32, 16, 16], dim=1)
    backend = PagedAttentionBackend(4, 2, 8, case.scale)
    cache = case.kv_cache.clone()
    out = backend.forward(q.view(5, 4, 8), k.view(5, 2, 8), v.view(5, 2, 8), cache, case.meta())
    assert out.shape == (5, 4, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), case.reference(), atol=ATOL, rtol=0)


def test_bad_shapes_raise_value_error():
    case = make_case([1, 3], [2, 0], num_heads=4, num_kv_heads=2, head_size=8, seed=11)
    backend = PagedAttentionBackend(4, 2, 8, case.scale)
    q, k, v = case.q.float(), case.k_new.float(), case.v_new.float()
    cache, meta = case.kv_cache.clone(), case.meta()
    with pytest.raises(ValueError, match="q shape"):
        backend.forward(q[:, :3], k, v, cache, meta)
    with pytest.raises(ValueError, match="k shape"):
        backend.forward(q, k[:3], v, cache, meta)
    with pytest.raises(ValueError, match="kv_cache shape"):
        backend.forward(q, k, v, cache[:, :, :2], meta)


def test_layers_sharing_one_step_metadata_each_read_their_own_cache():
    # the runner builds metadata once per step and every layer reuses it with its own cache:
    # same block layout (seed), different K/V per layer (data_seed)
    layers = [make_case([1, 1, 6], [12, 3, 5], block_size=4, seed=12, data_seed=d,
                        cache_dtype=torch.float64)
              for d in (20, 21)]
    assert layers[0].block_tables == layers[1].block_tables
    meta = layers[0].meta()
    backend = PagedAttentionBackend(9, 3, 16, layers[0].scale)
    for layer in layers + layers[:1]:
        out = backend.forward(layer.q.float(), layer.k_new.float(), layer.v_new.float(),
                              layer.kv_cache.float(), meta)
        torch.testing.assert_close(out.double(), layer.reference(), atol=ATOL, rtol=0)
    # a float64 layer on the same metadata gets masks in its own dtype
    out = backend.forward(layers[1].q, layers[1].k_new, layers[1].v_new,
                          layers[1].kv_cache.clone(), meta)
    torch.testing.assert_close(out, layers[1].reference(), atol=1e-12, rtol=0)
