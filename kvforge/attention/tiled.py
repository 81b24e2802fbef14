"""Tiled attention (FlashAttention's algorithm in PyTorch ops) over the paged KV cache.

Instead of a ``[q_len, kv_len]`` score matrix, queries are cut into tiles of ``q_tile`` rows and
keys/values into tiles of whole cache blocks (``kv_tile_tokens`` rounded down to blocks), read
straight from the cache through the block table. Each query row keeps a running max ``m``, a
running sum ``l`` and an unnormalised output ``acc``; a new K/V tile with scores ``s`` updates:

    m' = max(m, rowmax(s))          p = exp(s - m')          alpha = exp(m - m')
    l' = alpha * l + rowsum(p)      acc' = alpha * acc + p @ V_tile          (out = acc / l)

so the largest temporary is one ``[num_heads, q_tile, kv_tile]`` score tile, whatever the context
length: memory grows linearly (cache, q, output), never quadratically.

Which tiles a query tile visits (causal, context c = tokens cached before this chunk):

    keys:   0 ............................ c+i0 ..... c+i1-1 | c+i1 ...
            [tile][tile][tile]...[tile]  [diagonal tile(s)]   | never read
            full tiles: no mask           mask key_pos > query_pos

The first visited tile always holds key 0, which every query sees, so ``m`` is finite from the
first update on and fully masked rows of later tiles contribute exp(-inf) = 0.

Decodes (one query each) run together: tile j of every decode sequence is the j-th group of
block-table columns, with positions past a sequence's length masked (ragged contexts).
Numerics: scores, ``m``, ``l`` and ``acc`` are kept in at least float32.
"""
from __future__ import annotations

import itertools

import torch

from kvforge.attention.base import register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend, write_kv_cache


class _OnlineSoftmax:
    """Running (m, l, acc) for a batch of query rows; ``update`` folds in one K/V tile."""

    def __init__(self, rows_shape: tuple[int, ...], head_size_v: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.m = torch.full((*rows_shape, 1), float("-inf"), dtype=dtype, device=device)
        self.l = torch.zeros((*rows_shape, 1), dtype=dtype, device=device)
        self.acc = torch.zeros((*rows_shape, head_size_v), dtype=dtype, device=device)

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """scores [..., rows, L] (masked entries -inf), values [..., L, Dv] broadcastable."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1, keepdim=True))
        alpha = torch.exp(self.m - m_new)
        probs = torch.exp(scores.sub_(m_new))           # in place: the score tile is dead after
        self.l.mul_(alpha).add_(probs.sum(dim=-1, keepdim=True))
        self.acc.mul_(alpha).add_(probs @ values)
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l


@register_backend("tiled")
class TiledAttentionBackend(PagedAttentionBackend):
    """Same cache layout and contract as ``paged``; attention by online softmax over tiles."""

    q_tile: int = 128             # query rows per prefill tile
    kv_tile_tokens: int = 256     # keys per tile (rounded down to whole blocks, at least one)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self._check_inputs(q, k, v, kv_cache, meta)
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads, self.head_size_v)
        tile_blocks = max(1, self.kv_tile_tokens // meta.block_size)
        if meta.num_decodes:
            self._decode(q, kv_cache, meta, tile_blocks, out)
        starts = list(itertools.accumulate(meta.query_lens_list, initial=0))
        for i in range(meta.num_decodes, meta.num_seqs):
            query_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            if query_len:
                self._prefill_seq(q[starts[i]:starts[i + 1]], kv_cache, meta.block_tables[i],
                                  seq_len - query_len, meta.block_size, tile_blocks,
                                  out[starts[i]:starts[i + 1]])
        return out

    def _work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[n blocks] ids -> [n * block_size, KVH, D] tokens of those blocks, in table order."""
        return cache.index_select(0, block_ids).flatten(0, 1)

    # ------------------------------------------------------------------ decode
    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                tile_blocks: int, out: torch.Tensor) -> None:
        n, kvh, block_size = meta.num_decodes, self.num_kv_heads, meta.block_size
        group = self.num_heads // kvh
        work = self._work_dtype(q.dtype)
        # [n, KVH, group, 1, D]: query head h = kv_head * group + g reads KV head h // group
        queries = (q[:n].to(work) * self.scale).view(n, kvh, group, 1, self.head_size)
        seq_lens = meta.seq_lens[:n]
        state = _OnlineSoftmax((n, kvh, group, 1), self.head_size_v, work, q.device)
        num_blocks = -(-max(meta.seq_lens_list[:n]) // block_size)
        for b0 in range(0, num_blocks, tile_blocks):
            b1 = min(b0 + tile_blocks, num_blocks)
            ids = meta.block_tables[:n, b0:b1].reshape(-1)
            tile_len = (b1 - b0) * block_size
            # [n * tile_len, KVH, D] -> [n, KVH, 1, D, L] / [n, KVH, 1, L, Dv]
            keys = self._gather(kv_cache[0], ids).view(n, tile_len, kvh, -1).permute(0, 2, 3, 1)
            values = self._gather(kv_cache[1], ids).view(n, tile_len, kvh, -1).transpose(1, 2)
            scores = queries @ keys.to(work)[:, :, None]                    # [n, KVH, g, 1, L]
            key_pos = torch.arange(b0 * block_size, b0 * block_size + tile_len, device=q.device)
            beyond = (key_pos[None, :] >= seq_lens[:, None]).view(n, 1, 1, 1, tile_len)
            state.update(scores.masked_fill_(beyond, float("-inf")), values.to(work)[:, :, None])
        out[:n] = state.result().view(n, self.num_heads, self.head_size_v).to(out.dtype)

    # ----------------------------------------------------------------- prefill
    def _prefill_seq(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     context_len: int, block_size: int, tile_blocks: int,
                     out: torch.Tensor) -> None:
        """One sequence's chunk: q [Q, H, D] at positions context_len.. -> out [Q, H, Dv]."""
        kvh, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        work = self._work_dtype(q.dtype)
        tile_len = tile_blocks * block_size
        for i0 in range(0, q.shape[0], self.q_tile):
            i1 = min(i0 + self.q_tile, q.shape[0])
            rows = i1 - i0
            # [rows, H, D] -> [KVH, group, rows, D]
            queries = ((q[i0:i1].to(work) * self.scale).view(rows, kvh, group, -1)
                       .permute(1, 2, 0, 3))
            query_pos = torch.arange(context_len + i0, context_len + i1, device=q.device)
            state = _OnlineSoftmax((kvh, group, rows), self.head_size_v, work, q.device)
            last_key = context_len + i1            # keys [0, last_key) are visible to the tile
            for k0 in range(0, last_key, tile_len):
                k1 = min(k0 + tile_len, last_key)
                ids = block_table[k0 // block_size: -(-k1 // block_size)]
                keys = self._gather(kv_cache[0], ids)[: k1 - k0]            # [L, KVH, D]
                values = self._gather(kv_cache[1], ids)[: k1 - k0]
                scores = queries @ keys.to(work).permute(1, 2, 0)[:, None]  # [KVH, g, rows, L]
                if k1 - 1 > context_len + i0:       # some key is after some query: mask
                    key_pos = torch.arange(k0, k1, device=q.device)
                    future = key_pos[None, :] > query_pos[:, None]          # [rows, L]
                    scores.masked_fill_(future, float("-inf"))
                state.update(scores, values.to(work).transpose(0, 1)[:, None])
            out[i0:i1] = (state.result().permute(2, 0, 1, 3)
                          .reshape(rows, self.num_heads, self.head_size_v).to(out.dtype))
