"""Per-step attention inputs, built once by the ModelRunner and shared by every layer.

Batch layout (decodes first, then prefill chunks), T = total scheduled tokens:

    tokens:     [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      num_decode_tokens = 3
    query_start_loc: [0, 1, 2, 3, 7, 9]                (num_seqs + 1)
    seq_lens:        context after this step (cached + new), per sequence
    context_lens:    seq_lens - query_lens (tokens already in the cache before this step)

A token at position ``pos`` of a sequence lives in slot ``block_table[pos // B] * B + pos % B``
(B = block_size); ``slot_mapping[t]`` is that slot for every scheduled token t, where its K/V are
written before attention reads the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """One int64 tensor [num_seqs, max(1, longest table)] for every table, padded with block 0
    (never read: attention stops at each sequence's length); [1, 1] when there is none."""
    max_blocks = max(max((len(b) for b in block_tables), default=0), 1)
    return torch.tensor([b + [0] * (max_blocks - len(b)) for b in block_tables] or [[0]],
                        dtype=torch.int64)


@dataclass
class AttentionMetadata:
    num_decodes: int                 # sequences with exactly one query token, first in the batch
    num_decode_tokens: int           # == num_decodes
    slot_mapping: torch.Tensor       # [T] int64
    query_start_loc: torch.Tensor    # [num_seqs + 1] int64
    seq_lens: torch.Tensor           # [num_seqs] int64
    context_lens: torch.Tensor       # [num_seqs] int64
    block_tables: torch.Tensor       # [num_seqs, max_num_blocks] int64, padded with 0
    block_size: int
    # host copies for the per-sequence loops of prefill paths
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    # absolute position of every scheduled token (rotary embeddings), [T] int64
    token_positions: torch.Tensor | None = None

    @staticmethod
    def build(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Vectorised builder (no per-token Python loop). Decodes must come first."""
        num_seqs = len(query_lens)
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        bt = padded_block_tables(block_tables)[:num_seqs]
        if num_decodes == num_seqs:
            # every sequence adds one token at position = its context length: a few list
            # comprehensions and one tensor beat ~20 small tensor ops at decode batch sizes
            slots = [table[pos // block_size] * block_size + pos % block_size
                     for table, pos in zip(block_tables, context_lens)]
            seq_list = [c + 1 for c in context_lens]
            per_seq = torch.tensor([slots, context_lens, seq_list],
                                   dtype=torch.int64).reshape(3, num_seqs)
            slot_mapping, ctx, seq_lens = per_seq[0], per_seq[1], per_seq[2]
            qsl = torch.arange(num_seqs + 1, dtype=torch.int64)
            positions = ctx
        else:
            q_lens = torch.tensor(query_lens, dtype=torch.int64)
            ctx = torch.tensor(context_lens, dtype=torch.int64)
            seq_lens = q_lens + ctx
            qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
            torch.cumsum(q_lens, 0, out=qsl[1:])
            total = int(qsl[-1])
            # position of every scheduled token inside its own sequence
            seq_idx = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
            positions = torch.arange(total, dtype=torch.int64) - qsl[:-1][seq_idx] + ctx[seq_idx]
            slot_mapping = bt[seq_idx, positions // block_size] * block_size + positions % block_size
            seq_list = seq_lens.tolist()
        return AttentionMetadata(
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            slot_mapping=slot_mapping.to(device), query_start_loc=qsl.to(device),
            seq_lens=seq_lens.to(device), context_lens=ctx.to(device),
            block_tables=bt.to(device), block_size=block_size,
            query_lens_list=list(query_lens), seq_lens_list=seq_list,
            max_seq_len=max(seq_list, default=0), token_positions=positions.to(device))

    def positions(self) -> torch.Tensor:
        """Absolute position of each scheduled token (for rotary embeddings)."""
        if self.token_positions is not None:
            return self.token_positions
        seq_idx = torch.repeat_interleave(
            torch.arange(self.num_seqs, device=self.query_start_loc.device),
            self.query_start_loc[1:] - self.query_start_loc[:-1])
        total = int(self.query_start_loc[-1])
        return (torch.arange(total, device=seq_idx.device) - self.query_start_loc[:-1][seq_idx]
                + self.context_lens[seq_idx])
