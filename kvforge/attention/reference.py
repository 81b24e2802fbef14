"""Dense causal attention over contiguous per-sequence K/V: the specification every backend meets.

Deliberately plain (a loop over sequences and query heads, explicit softmax) so that it is
obviously right; it runs in whatever dtype it is given, so tests pass float64 inputs.

Packed layout (two sequences, the first with 2 cached tokens and 2 new ones):

    q:  [ q0_2 q0_3 | q1_0 q1_1 q1_2 ]              T = sum(query_lens) rows
    k:  [ k0_0 k0_1 k0_2 k0_3 | k1_0 k1_1 k1_2 ]    sum(context_lens + query_lens) rows
            cached    new
    query i of sequence s sits at absolute position context_lens[s] + i and sees keys 0..that.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           query_lens: Sequence[int], context_lens: Sequence[int]) -> torch.Tensor:
    """Reference attention.

    q ``[T, H, D]`` (new tokens only), k ``[S, KVH, D]`` and v ``[S, KVH, Dv]`` (every sequence's
    full K/V: its context then its new tokens), with ``T = sum(query_lens)`` and
    ``S = sum(context_lens) + T``. Query head h reads KV head ``h // (H // KVH)``.
    Returns ``[T, H, Dv]`` in q's dtype.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError(f"query_lens has {len(query_lens)} entries, "
                         f"context_lens has {len(context_lens)}")
    if any(n < 0 for n in query_lens) or any(n < 0 for n in context_lens):
        raise ValueError(f"lengths must be >= 0: query_lens={list(query_lens)}, "
                         f"context_lens={list(context_lens)}")
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
    if sum(query_lens) != num_tokens:
        raise ValueError(f"sum(query_lens)={sum(query_lens)} but q has {num_tokens} tokens")
    if sum(query_lens) + sum(context_lens) != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} rows, expected "
                         f"{sum(query_lens) + sum(context_lens)}")
    group = num_heads // num_kv_heads

    out = q.new_zeros(num_tokens, num_heads, v.shape[-1])
    q_start = kv_start = 0
    for q_len, ctx_len in zip(query_lens, context_lens):
        seq_len = ctx_len + q_len
        q_pos = torch.arange(ctx_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]                       # [q_len, seq_len]
        for h in range(num_heads):
            qh = q[q_start:q_start + q_len, h]                             # [q_len, D]
            kh = k[kv_start:kv_start + seq_len, h // group]                # [seq_len, D]
            vh = v[kv_start:kv_start + seq_len, h // group]
            scores = (qh @ kh.T) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_start:q_start + q_len, h] = probs @ vh
        q_start += q_len
        kv_start += seq_len
    return out
