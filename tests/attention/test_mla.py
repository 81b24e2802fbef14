"""MLA backend: the latent cache layout, absorbed == naive, both == dense attention on explicitly
up-projected K/V (the spec, float64)."""
from __future__ import annotations

import pytest
import torch

from kvforge.attention.base import get_backend_cls
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla import MLAAttentionBackend, MLAUpProjection
from kvforge.attention.reference import dense_causal_attention

H, L, P, R, V = 4, 32, 16, 8, 12       # heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim
BLOCK = 4
NUM_BLOCKS = 40
SCALE = (P + R) ** -0.5
# (context_len, query_len): two decodes, a later prefill chunk, a fresh prefill
SEQS = [(5, 1), (12, 1), (6, 5), (0, 7)]


def make_up(seed: int = 0) -> MLAUpProjection:
    g = torch.Generator().manual_seed(seed)
    up = MLAUpProjection(H, L, P, V, dtype=torch.float64)
    up.load_kv_b(torch.randn(H * (P + V), L, generator=g, dtype=torch.float64) * 0.3)
    return up


def block_tables() -> list[list[int]]:
    """Sequence s owns blocks 10 s + 9, 10 s + 8, ...: reversed, never contiguous."""
    return [[10 * s + 9 - j for j in range(-(-(ctx + q) // BLOCK))] for s, (ctx, q) in enumerate(SEQS)]


def slot(table: list[int], pos: int) -> int:
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def make_batch(seed: int = 1):
    """Random float64 entries for every sequence's whole context + new tokens; the context part
    is written into the cache beforehand (as earlier steps would have)."""
    g = torch.Generator().manual_seed(seed)
    tables = block_tables()
    meta = AttentionMetadata.build([q for _, q in SEQS], [c for c, _ in SEQS], tables, BLOCK)
    cache = torch.zeros(1, NUM_BLOCKS, BLOCK, L + R, dtype=torch.float64)
    all_entries, new_entries = [], []
    for (ctx, q_len), table in zip(SEQS, tables):
        entries = torch.randn(ctx + q_len, L + R, generator=g, dtype=torch.float64)
        for pos in range(ctx):
            cache[0].view(-1, L + R)[slot(table, pos)] = entries[pos]
        all_entries.append(entries)
        new_entries.append(entries[ctx:])
    q = torch.randn(sum(q for _, q in SEQS), H, P + R, generator=g, dtype=torch.float64)
    return meta, cache, q, torch.cat(new_entries), all_entries


def dense_reference(q, all_entries, up: MLAUpProjection) -> torch.Tensor:
    """Per-head K/V built explicitly from the entries, then the dense spec attention."""
    keys, values = [], []
    for entries in all_entries:
        c, k_pe = entries[:, :L], entries[:, L:]
        k_nope = torch.einsum("sl,hpl->shp", c, up.w_uk)
        keys.append(torch.cat([k_nope, k_pe[:, None].expand(-1, H, R)], -1))
        values.append(torch.einsum("sl,hvl->shv", c, up.w_uv))
    return dense_causal_attention(q, torch.cat(keys), torch.cat(values), SCALE,
                                  [q for _, q in SEQS], [c for c, _ in SEQS])


@pytest.mark.parametrize("decode_path,prefill_path",
                         [("absorbed", "naive"), ("absorbed", "absorbed"), ("naive", "naive")])
def test_paths_match_dense_reference(decode_path, prefill_path):
    up = make_up()
    meta, cache, q, latent, all_entries = make_batch()
    backend = MLAAttentionBackend(H, L, P, R, V, SCALE, decode_path=decode_path,
                                  prefill_path=prefill_path)
    out = backend.forward(q, latent, up, cache, meta)
    assert out.shape == (q.shape[0], H, V)
    torch.testing.assert_close(out, dense_reference(q, all_entries, up), atol=1e-10, rtol=1e-9)


def test_absorbed_and_naive_agree_on_the_same_batch_in_fp32():
    up = make_up().float()
    meta, cache, q, latent, _ = make_batch(seed=3)
    outs = {}
    for path in ("absorbed", "naive"):
        backend = MLAAttentionBackend(H, L, P, R, V, SCALE, decode_path=path, prefill_path=path)
        outs[path] = backend.forward(q.float(), latent.float(), up, cache.float().clone(), meta)
    torch.testing.assert_close(outs["absorbed"], outs["naive"], atol=1e-5, rtol=1e-5)
    # and the paths really differ in how they compute: not the same tensor by construction
    assert not torch.equal(outs["absorbed"], outs["naive"])


def test_cache_holds_only_latent_entries():
    backend = get_backend_cls("mla")(H, L, P, R, V, SCALE)
    assert backend.kv_cache_shape(NUM_BLOCKS, BLOCK) == (1, NUM_BLOCKS, BLOCK, L + R)
    meta, cache, q, latent, _ = make_batch()
    before = cache.clone()
    backend.forward(q, latent, make_up(), cache, meta)
    written = cache[0].view(-1, L + R)
    torch.testing.assert_close(written[meta.slot_mapping], latent, atol=0, rtol=0)
    untouched = torch.ones(written.shape[0], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(written[untouched], before[0].view(-1, L + R)[untouched])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="decode_path 'fast'"):
        MLAAttentionBackend(H, L, P, R, V, SCALE, decode_path="fast")
    backend = MLAAttentionBackend(H, L, P, R, V, SCALE)
    meta, cache, q, latent, _ = make_batch()
    with pytest.raises(ValueError, match="latent shape"):
        backend.forward(q, latent[:, :L], make_up(), cache, meta)
    with pytest.raises(ValueError, match="kv_cache shape"):
        backend.forward(q, latent, make_up(), cache[0], meta)
    with pytest.raises(ValueError, match="kv_b_proj.weight has shape"):
        MLAUpProjection(H, L, P, V).load_kv_b(torch.zeros(H * P, L))
