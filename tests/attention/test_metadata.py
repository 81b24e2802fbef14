"""AttentionMetadata.build against a per-token Python reference, for decode-only batches (its
list fast path) and mixed ones (its tensor path)."""
from __future__ import annotations

import random

import pytest
import torch

from kvforge.attention.metadata import AttentionMetadata


def _reference(query_lens, context_lens, block_tables, block_size):
    positions, slots = [], []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        for pos in range(c, c + q):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return positions, slots


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_matches_per_token_reference(decode_only, seed):
    rng = random.Random(seed)
    block_size, num_seqs = rng.choice([1, 4, 16]), rng.randint(1, 9)
    num_decodes = num_seqs if decode_only else rng.randint(0, num_seqs - 1)
    query_lens = [1] * num_decodes + [rng.randint(2, 20) for _ in range(num_seqs - num_decodes)]
    context_lens = [rng.randint(0, 40) for _ in range(num_seqs)]
    free = list(range(200))
    rng.shuffle(free)
    block_tables = [[free.pop() for _ in range(-(-(c + q) // block_size))]
                    for q, c in zip(query_lens, context_lens)]
    meta = AttentionMetadata.build(query_lens, context_lens, block_tables, block_size)
    positions, slots = _reference(query_lens, context_lens, block_tables, block_size)
    assert meta.num_decodes == num_decodes and meta.num_seqs == num_seqs
    assert meta.positions().tolist() == positions and meta.slot_mapping.tolist() == slots
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    assert meta.seq_lens.tolist() == seq_lens == meta.seq_lens_list
    assert meta.context_lens.tolist() == context_lens and meta.max_seq_len == max(seq_lens)
    assert meta.query_start_loc.tolist() == [sum(query_lens[:i]) for i in range(num_seqs + 1)]
    width = max(len(t) for t in block_tables)
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in block_tables]
    for t in (meta.slot_mapping, meta.seq_lens, meta.context_lens, meta.block_tables):
        assert t.dtype == torch.int64


def test_build_empty_batch():
    meta = AttentionMetadata.build([], [], [], 16)
    assert meta.num_seqs == 0 and meta.slot_mapping.numel() == 0
    assert meta.block_tables.shape[0] == 0 and meta.max_seq_len == 0
