"""Factories for attention-backend tests: random paged layouts with a dense oracle.

A case scatters every sequence's cached context into a cache whose blocks are a random
permutation of block ids, filled elsewhere with loud noise (so reading an unowned slot shows),
and keeps the same K/V contiguously per sequence for ``dense_causal_attention``. Slots are
computed here with a per-token loop over the block-table lists, independently of
``AttentionMetadata.build``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import dense_causal_attention


@dataclass
class PagedCase:
    q: torch.Tensor                 # [T, H, D] float64, new tokens
    k_new: torch.Tensor             # [T, KVH, D] float64
    v_new: torch.Tensor
    k_full: list[torch.Tensor]      # per sequence [ctx + q, KVH, D] float64: context then new
    v_full: list[torch.Tensor]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    kv_cache: torch.Tensor          # [2, num_blocks, block_size, KVH, D], contexts written
    scale: float

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables,
                                       self.block_size)

    def slot(self, seq: int, pos: int) -> tuple[int, int]:
        """(block id, offset) of a sequence's token position."""
        return self.block_tables[seq][pos // self.block_size], pos % self.block_size

    def reference(self) -> torch.Tensor:
        return dense_causal_attention(self.q, torch.cat(self.k_full), torch.cat(self.v_full),
                                      self.scale, self.query_lens, self.context_lens)

    def expected_cache(self) -> torch.Tensor:
        """The cache after a forward: every new token's K/V at its slot, the rest unchanged."""
        cache = self.kv_cache.clone()
        for s, (ctx, q_len) in enumerate(zip(self.context_lens, self.query_lens)):
            for pos in range(ctx, ctx + q_len):
                block, offset = self.slot(s, pos)
                cache[0, block, offset] = self.k_full[s][pos].to(cache.dtype)
                cache[1, block, offset] = self.v_full[s][pos].to(cache.dtype)
        return cache


def make_case(query_lens: list[int], context_lens: list[int], *, num_heads: int = 9,
              num_kv_heads: int = 3, head_size: int = 16, block_size: int = 4, seed: int = 0,
              data_seed: int | None = None,
              shared_prefix_blocks: int = 0, spare_blocks: int = 3,
              cache_dtype: torch.dtype = torch.float32) -> PagedCase:
    """``seed`` picks the block layout, ``data_seed`` (default: seed) the q/K/V and noise.

    Sequences 0 and 1 share their first ``shared_prefix_blocks`` physical blocks (and the
    K/V in them) when that is > 0; both contexts must cover those blocks."""
    if len(query_lens) != len(context_lens):
        raise ValueError(f"{len(query_lens)} query lens vs {len(context_lens)} context lens")
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    shared = shared_prefix_blocks
    if shared and (len(seq_lens) < 2 or min(context_lens[:2]) < shared * block_size):
        raise ValueError(f"shared_prefix_blocks={shared} needs two contexts "
                         f">= {shared * block_size}")

    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) - shared + spare_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = []
    for s, n in enumerate(blocks_needed):
        if s == 1 and shared:
            block_tables.append(block_tables[0][:shared] + [free.pop() for _ in range(n - shared)])
        else:
            block_tables.append([free.pop() for _ in range(n)])
    if data_seed is not None:
        gen = torch.Generator().manual_seed(data_seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k_full = [rand(n, num_kv_heads, head_size) for n in seq_lens]
    v_full = [rand(n, num_kv_heads, head_size) for n in seq_lens]
    if shared:
        k_full[1][: shared * block_size] = k_full[0][: shared * block_size]
        v_full[1][: shared * block_size] = v_full[0][: shared * block_size]

    # noise everywhere, so a read of a slot the sequence does not own changes the output
    kv_cache = (100 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_size,
                                  generator=gen)).to(cache_dtype)
    case = PagedCase(
        q=rand(sum(query_lens), num_heads, head_size),
        k_new=torch.cat([kf[c:] for kf, c in zip(k_full, context_lens)]),
        v_new=torch.cat([vf[c:] for vf, c in zip(v_full, context_lens)]),
        k_full=k_full, v_full=v_full, query_lens=list(query_lens),
        context_lens=list(context_lens), block_tables=block_tables, block_size=block_size,
        kv_cache=kv_cache, scale=head_size ** -0.5)
    for s, ctx in enumerate(context_lens):
        for pos in range(ctx):
            block, offset = case.slot(s, pos)
            kv_cache[0, block, offset] = k_full[s][pos].to(cache_dtype)
            kv_cache[1, block, offset] = v_full[s][pos].to(cache_dtype)
    return case
