"""Paged attention in plain PyTorch: K/V live in fixed-size blocks addressed by block tables.

One layer's cache (``kv_cache_shape``)::

    kv_cache[0] = K, kv_cache[1] = V, each  [num_blocks, block_size, num_kv_heads, head_size]
    flattened to slots:                     [num_blocks * block_size, num_kv_heads, head_size]
    slot = block_id * block_size + offset

    block_table (B = 4):  [7, 2, 5]      token at position 9 -> block_table[9 // 4] = 5,
                                          offset 9 % 4 = 1 -> slot 5 * 4 + 1 = 21

A step first scatters the new tokens' K/V into their slots, then attends:

- decodes (one query each, first in the batch) in slices of sequences: one ``index_select`` of
  the slice's blocks gives K/V ``[n, L, KVH, D]`` (L = the slice's longest context rounded up to
  whole blocks, shorter ones masked); q is viewed as ``[n, KVH, group, D]`` so each KV head
  serves its group of query heads without copying K/V.
- prefill chunks, one sequence at a time, through ``scaled_dot_product_attention``: a chunk with
  no cached context uses its own K/V and ``is_causal``; a later chunk gathers its whole
  context from the cache and uses a causal mask shifted by the context length.
- prompt rows (``layers/prompt_rows.py``: the forward of the sequences prefilling their
  prompt) in fixed tiles of positions instead (``attention/prompt_tiles.py``), so each row
  rounds alike however the prompt was split.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.attention.base import AttentionBackend, register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.prompt_tiles import prompt_attention
from kvforge.kernels import ops as kernel_ops
from kvforge.layers.prompt_rows import computing_prompt_rows

# ``enable_gqa`` arrived in torch 2.5; the CPU flash kernel handles it without repeating K/V.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter token t's K/V into slot ``slot_mapping[t]`` of ``kv_cache`` (in place)."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    key_slots = kv_cache[0].view(-1, num_kv_heads, head_size)
    value_slots = kv_cache[1].view(-1, num_kv_heads, kv_cache.shape[-1])
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.element_size() == 1 and kv_cache.is_floating_point():
        # fp8 caches: index_copy_ has no fp8 kernel on CPU, so copy the bytes
        key_slots, value_slots = key_slots.view(torch.uint8), value_slots.view(torch.uint8)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    key_slots.index_copy_(0, slot_mapping, k)
    value_slots.index_copy_(0, slot_mapping, v)


def shifted_causal_mask(context_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """``[query_len, context_len + query_len]`` bool, True where query i may see key j.

    Query i sits at absolute position context_len + i and sees keys 0..context_len + i::

        context_len = 2, query_len = 3     keys: 0 1 2 3 4
                                    q0 (pos 2)   1 1 1 0 0
                                    q1 (pos 3)   1 1 1 1 0
                                    q2 (pos 4)   1 1 1 1 1
    """
    key_pos = torch.arange(context_len + query_len, device=device)
    query_pos = torch.arange(context_len, context_len + query_len, device=device)
    return key_pos[None, :] <= query_pos[:, None]


@dataclass
class _DecodeSlice:
    start: int                  # decode sequences [start, end) of the batch
    end: int
    padded_len: int             # longest context in the slice, rounded up to whole blocks
    block_ids: torch.Tensor     # [(end - start) * padded_len // block_size]
    mask: torch.Tensor          # [end - start, 1, 1, padded_len] additive: 0 or -inf (padding)
    block_table: torch.Tensor   # [end - start, padded_len // block_size] (the compiled kernel's input)
    seq_lens: torch.Tensor      # [end - start]


@dataclass
class _PrefillChunk:
    t0: int                     # the chunk's tokens [t0, t1) in the batch
    t1: int
    seq_len: int
    block_ids: torch.Tensor | None   # None: no cached context, attend over the chunk's own K/V
    mask: torch.Tensor | None        # shifted causal mask, None when is_causal suffices


@dataclass
class _StepPlan:
    """Index tensors and masks of one step; every layer's forward reuses them."""
    decode_slices: list[_DecodeSlice]
    prefill_chunks: list[_PrefillChunk]


def _build_plan(meta: AttentionMetadata, seqs_per_slice_budget: int, bytes_per_token: int,
                dtype: torch.dtype) -> _StepPlan:
    device = meta.block_tables.device
    block_size = meta.block_size
    seq_lens = meta.seq_lens_list
    decode_slices = []
    if meta.num_decodes:
        max_len = max(seq_lens[:meta.num_decodes])
        seqs_per_slice = max(1, seqs_per_slice_budget // (bytes_per_token * max_len))
        for start in range(0, meta.num_decodes, seqs_per_slice):
            end = min(start + seqs_per_slice, meta.num_decodes)
            num_blocks = -(-max(seq_lens[start:end]) // block_size)
            padded_len = num_blocks * block_size
            # positions past a sequence's length (and the 0-padded block ids) are masked out
            padding = (torch.arange(padded_len, device=device)[None, :]
                       >= meta.seq_lens[start:end, None])[:, None, None, :]
            mask = torch.zeros(padding.shape, dtype=dtype, device=device)
            table = meta.block_tables[start:end, :num_blocks]
            decode_slices.append(_DecodeSlice(
                start, end, padded_len, block_ids=table.reshape(-1),
                mask=mask.masked_fill_(padding, float("-inf")), block_table=table,
                seq_lens=meta.seq_lens[start:end]))
    prefill_chunks = []
    # host-side token offsets: query_start_loc without a device sync
    starts = list(itertools.accumulate(meta.query_lens_list, initial=0))
    for i in range(meta.num_decodes, meta.num_seqs):
        query_len, seq_len = meta.query_lens_list[i], seq_lens[i]
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        if context_len == 0:
            block_ids = mask = None
        else:
            block_ids = meta.block_tables[i, :-(-seq_len // block_size)]
            mask = shifted_causal_mask(context_len, query_len, device)
        prefill_chunks.append(_PrefillChunk(starts[i], starts[i + 1], seq_len, block_ids, mask))
    return _StepPlan(decode_slices, prefill_chunks)


@register_backend("paged")
class PagedAttentionBackend(AttentionBackend):
    """Paged attention for any device in plain PyTorch; fp32 decodes on CPU use the compiled
    kernel (kvforge/kernels) when it is available."""

    # Gathered decode K+V per slice. Small enough to stay in the last-level cache between the
    # gather and the attention that reads it (one big gather of a large batch's whole context
    # would spill to memory between the two), and it bounds the temporary memory of long contexts.
    decode_gather_bytes: int = 8 * 2**20

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self._check_inputs(q, k, v, kv_cache, meta)
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape[0], self.num_heads, self.head_size_v)
        if computing_prompt_rows():
            prompt_attention(self, q, kv_cache, meta, None, out)
            return out
        plan = self._plan(meta, kv_cache, q.dtype)
        if plan.decode_slices:
            self._decode(q, kv_cache, plan.decode_slices, out)
        if plan.prefill_chunks:
            self._prefill(q, k, v, kv_cache, plan.prefill_chunks, out)
        return out

    def _plan(self, meta: AttentionMetadata, kv_cache: torch.Tensor,
              dtype: torch.dtype) -> _StepPlan:
        """The step's plan, built by the first layer and kept on the (per-step) metadata.

        Assumes metadata is not mutated in place after ``build`` (it is rebuilt every step).
        """
        bytes_per_token = (self.num_kv_heads * (self.head_size + self.head_size_v)
                           * kv_cache.element_size())
        key = (self.decode_gather_bytes, bytes_per_token, dtype)
        plans = meta.__dict__.setdefault("_paged_plans", {})
        if key not in plans:
            plans[key] = _build_plan(meta, self.decode_gather_bytes, bytes_per_token, dtype)
        return plans[key]

    def _gather_kv(self, kv_cache: torch.Tensor,
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots [N]``: ``[N, KVH, D]`` each (fresh tensors)."""
        kvh = self.num_kv_heads
        keys = kv_cache[0].view(-1, kvh, self.head_size).index_select(0, slots)
        values = kv_cache[1].view(-1, kvh, self.head_size_v).index_select(0, slots)
        return keys, values

    # ------------------------------------------------------------------ decode
    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, slices: list[_DecodeSlice],
                out: torch.Tensor) -> None:
        kvh, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        for sl in slices:
            # compiled kernel (fp32 CPU): reads the blocks in place, no gather, no mask
            attn = kernel_ops.paged_decode_attention(q[sl.start:sl.end], key_cache, value_cache,
                                                     sl.block_table, sl.seq_lens, self.scale)
            if attn is not None:
                out[sl.start:sl.end] = attn
                continue
            n = sl.end - sl.start
            # [n * num_blocks] block ids -> one gather -> [n, L, KVH, D] -> view [n, KVH, L, D]
            keys = (key_cache.index_select(0, sl.block_ids)
                    .view(n, sl.padded_len, kvh, -1).transpose(1, 2))
            values = (value_cache.index_select(0, sl.block_ids)
                      .view(n, sl.padded_len, kvh, -1).transpose(1, 2))
            # query head h = kv_head * group + g reads KV head h // group: a view, not a copy
            queries = q[sl.start:sl.end].view(n, kvh, group, self.head_size)
            attn = F.scaled_dot_product_attention(
                queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=sl.mask, scale=self.scale)
            out[sl.start:sl.end] = attn.reshape(n, self.num_heads, self.head_size_v)

    # ----------------------------------------------------------------- prefill
    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 chunks: list[_PrefillChunk], out: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kvh = self.num_kv_heads
        for c in chunks:
            if c.block_ids is None:
                # the whole sequence is in this step: its own K/V, no gather
                keys, values = k[c.t0:c.t1], v[c.t0:c.t1]
            else:
                keys = (key_cache.index_select(0, c.block_ids)
                        .view(-1, kvh, self.head_size)[:c.seq_len])
                values = (value_cache.index_select(0, c.block_ids)
                          .view(-1, kvh, self.head_size_v)[:c.seq_len])
            out[c.t0:c.t1] = self._sdpa(q[c.t0:c.t1], keys.to(q.dtype), values.to(q.dtype), c.mask)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of one sequence: q [Q, H, D], k/v [S, KVH, D] -> [Q, H, Dv].

        ``mask`` None means S == Q and plain (top-left) causal attention.
        """
        query_len = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]     # [1, KVH, S, D]
        if group == 1 or _SDPA_HAS_GQA:
            queries = q.transpose(0, 1)[None]                                # [1, H, Q, D]
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                **({"enable_gqa": True} if group > 1 else {}))
            return attn[0].transpose(0, 1)
        # older torch: fold each KV head's query group into the sequence dim, tiling the mask
        #   q [Q, KVH*group, D] -> [1, KVH, group*Q, D]   (row g*Q + i is head kv*group+g, query i)
        if mask is None:
            mask = shifted_causal_mask(0, query_len, q.device)
        queries = (q.view(query_len, self.num_kv_heads, group, -1).permute(1, 2, 0, 3)
                   .reshape(1, self.num_kv_heads, group * query_len, -1))
        attn = F.scaled_dot_product_attention(queries, keys, values,
                                              attn_mask=mask.repeat(group, 1), scale=self.scale)
        return (attn.view(self.num_kv_heads, group, query_len, -1).permute(2, 0, 1, 3)
                .reshape(query_len, self.num_heads, -1))

    # -------------------------------------------------------------- validation
    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Shape checks only (Python ints, no device sync)."""
        num_tokens = q.shape[0]
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(f"q shape {tuple(q.shape)}, expected [T, {self.num_heads}, "
                             f"{self.head_size}]")
        if k.shape != (num_tokens, self.num_kv_heads, self.head_size):
            raise ValueError(f"k shape {tuple(k.shape)}, expected [{num_tokens}, "
                             f"{self.num_kv_heads}, {self.head_size}]")
        if v.shape != (num_tokens, self.num_kv_heads, self.head_size_v):
            raise ValueError(f"v shape {tuple(v.shape)}, expected [{num_tokens}, "
                             f"{self.num_kv_heads}, {self.head_size_v}]")
        if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != meta.block_size
                or kv_cache.shape[3:] != (self.num_kv_heads, self.head_size)):
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)}, expected [2, num_blocks, "
                             f"{meta.block_size}, {self.num_kv_heads}, {self.head_size}]")
        if meta.slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                             f"{num_tokens} tokens")
