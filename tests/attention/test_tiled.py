"""TiledAttentionBackend (online softmax over K/V tiles) against the dense reference."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvforge import LLM, SamplingParams
from kvforge.attention.base import get_backend_cls
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import dense_causal_attention
from kvforge.attention.tiled import TiledAttentionBackend
from tests.attention.paged_cases import PagedCase, make_case

HEAD_LAYOUTS = [(8, 2), (4, 1), (4, 4), (12, 3)]     # GQA 4, MQA, MHA, GQA 4 with more heads


def run_tiled(case: PagedCase, q_tile: int, kv_tile_tokens: int, dtype=torch.float64):
    num_heads, num_kv_heads, head_size = case.q.shape[1], case.k_new.shape[1], case.q.shape[2]
    backend = get_backend_cls("tiled")(num_heads, num_kv_heads, head_size, case.scale)
    backend.q_tile, backend.kv_tile_tokens = q_tile, kv_tile_tokens
    cache = case.kv_cache.to(dtype)
    out = backend.forward(case.q.to(dtype), case.k_new.to(dtype), case.v_new.to(dtype), cache,
                          case.meta())
    return out, cache


class LargestNewTensor(TorchDispatchMode):
    """Records the largest tensor storage any op creates (views of existing storage excluded):
    an external measure of an attention implementation's biggest intermediate."""

    def __init__(self) -> None:
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.max_bytes = max(self.max_bytes, t.untyped_storage().nbytes())
        return out


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_dense_reference_in_float64(seed):
    rng = random.Random(seed)
    num_heads, num_kv_heads = HEAD_LAYOUTS[seed % len(HEAD_LAYOUTS)]
    head_size = (64, 128)[seed % 2]
    block_size = rng.choice([4, 16])
    num_decodes, num_prefills = rng.randint(0, 3), rng.randint(1, 2)
    query_lens = [1] * num_decodes + [rng.choice([2, rng.randint(3, 80), 150])
                                      for _ in range(num_prefills)]
    context_lens = [rng.randint(0, 300) for _ in query_lens]          # ragged, 0 = fresh prompt
    case = make_case(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_size=head_size, block_size=block_size, seed=seed,
                     cache_dtype=torch.float64)
    # small tiles so every path (several q tiles, several kv tiles, diagonal masks) is taken
    out, cache = run_tiled(case, q_tile=rng.choice([32, 64]), kv_tile_tokens=rng.choice([32, 80]))
    torch.testing.assert_close(out, case.reference(), atol=1e-10, rtol=1e-10)
    assert torch.equal(cache, case.expected_cache())      # new K/V written where they belong


def test_512_query_chunk_after_ragged_context_matches_reference():
    case = make_case([1, 512], [37, 90], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                     seed=9, cache_dtype=torch.float64)
    out, _ = run_tiled(case, q_tile=128, kv_tile_tokens=128)
    torch.testing.assert_close(out, case.reference(), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_LAYOUTS[:3])
def test_float32_matches_reference_with_default_tiles(num_heads, num_kv_heads):
    case = make_case([1, 1, 300, 40], [700, 5, 0, 333], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_size=64, block_size=16, seed=3)
    out, _ = run_tiled(case, TiledAttentionBackend.q_tile, TiledAttentionBackend.kv_tile_tokens,
                       dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), case.reference(), atol=2e-5, rtol=1e-4)


def test_shared_prefix_blocks_and_tile_smaller_than_a_block():
    case = make_case([1, 9], [20, 14], block_size=8, shared_prefix_blocks=1, seed=5,
                     cache_dtype=torch.float64)
    out, _ = run_tiled(case, q_tile=4, kv_tile_tokens=3)        # rounds up to one block per tile
    torch.testing.assert_close(out, case.reference(), atol=1e-10, rtol=1e-10)


def test_largest_intermediate_stays_below_dense_scores_and_flat_in_context():
    """At long context the biggest tensor the tiled backend creates is one score tile, far below
    the [heads, q_len, kv_len] dense scores, and it does not grow with the context length; the
    dense reference's biggest intermediate does (so the probe can see quadratic memory)."""
    heads, head_size, block_size, query_len = 4, 64, 16, 128
    torch.manual_seed(0)
    largest = {}
    for context_len in (512, 2048):
        seq_len = context_len + query_len
        num_blocks = -(-seq_len // block_size)
        cache = torch.randn(2, num_blocks, block_size, heads, head_size)
        meta = AttentionMetadata.build([query_len], [context_len], [list(range(num_blocks))],
                                       block_size)
        q, k, v = (torch.randn(query_len, heads, head_size) for _ in range(3))
        with LargestNewTensor() as probe:
            TiledAttentionBackend(heads, heads, head_size, 0.125).forward(q, k, v, cache, meta)
        largest[context_len] = probe.max_bytes
    dense_scores_bytes = heads * query_len * (2048 + query_len) * 4
    assert largest[2048] < dense_scores_bytes / 4, (largest, dense_scores_bytes)
    assert largest[2048] == largest[512]
    # the probe does see a dense implementation's scores grow with the context
    dense = {}
    for context_len in (1024, 4096):
        kv = torch.randn(context_len + 8, 1, head_size)
        with LargestNewTensor() as probe:
            dense_causal_attention(torch.randn(8, 1, head_size), kv, kv, 0.125, [8], [context_len])
        dense[context_len] = probe.max_bytes
    assert dense[4096] > 3 * dense[1024]


@pytest.mark.slow
def test_engine_greedy_tiled_equals_paged(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)   # same model as test_invariance
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (3, 29, 70, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for backend in ("paged", "tiled"):
        llm = LLM(path, block_size=4, num_kv_blocks=96, max_num_batched_tokens=32,
                  attention_backend=backend)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == 96
    assert tokens["tiled"] == tokens["paged"]
