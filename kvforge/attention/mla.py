"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged LATENT cache.

The cache holds, per token and layer, ONE entry of ``L + R`` values instead of per-head K and V::

    entry = [ c_kv (L = kv_lora_rank) | k_pe (R = qk_rope_head_dim) ]
    c_kv: compressed KV latent (kv_a_proj_with_mqa output after kv_a_layernorm)
    k_pe: the decoupled RoPE key, shared by every head, already rotated

Every head's key and value are linear in c_kv. With kv_b_proj viewed as ``[H, P + V, L]``
(P = qk_nope_head_dim, V = v_head_dim)::

    W_UK[h] = kv_b[h, :P]   [P, L]        k_nope[s, h] = W_UK[h] @ c_kv[s]
    W_UV[h] = kv_b[h, P:]   [V, L]        v[s, h]      = W_UV[h] @ c_kv[s]

    score(t, s, h) = scale * (q_nope[t,h] . k_nope[s,h] + q_pe[t,h] . k_pe[s])
                   = scale * ((W_UK[h]^T q_nope[t,h]) . c_kv[s] + q_pe[t,h] . k_pe[s])
                   = scale * [q_lat | q_pe] . [c_kv | k_pe]          q_lat = W_UK[h]^T q_nope
    out[t, h]      = sum_s p(t,s,h) v[s,h] = W_UV[h] @ (sum_s p(t,s,h) c_kv[s])

so the ABSORBED form is multi-query attention with one KV "head": key = the whole cache entry,
value = its c_kv part; W_UK is folded into the query before and W_UV applied after attention.
It reads only the latent cache, which is why decode uses it. The NAIVE form up-projects the
context's c_kv to full per-head K/V and runs ordinary attention: cheaper when many queries share
the context (a prefill chunk: the up-projection costs S*L*H*(P+V) once, while absorbed scores
would cost Q*S*H*(2L+R) with L = 512 > P+R = 192 in DeepSeek-V2), so prefill uses it.

One layer's cache tensor is ``[1, num_blocks, block_size, L + R]``: the leading plane dimension
of size 1 keeps the engine-wide convention "dim 1 indexes blocks" (copy-on-write does
``cache[:, dst] = cache[:, src]``), the entry serving as both key and value.

Absorbed, heads folded into the query rows (no K/V copy, one matmul per sequence)::

    queries [n, Q, H, L+R] -> view [n, 1, Q*H, L+R]   row q*H + h = query q, head h
    keys    [n, 1, S, L+R] (the gathered entries),  values = keys[..., :L]
    mask    [Q, S] causal -> repeat_interleave(H) -> [Q*H, S]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention.base import AttentionBackend, register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import _build_plan, shifted_causal_mask

PATHS = ("naive", "absorbed")


class MLAUpProjection(nn.Module):
    """kv_b_proj kept as the two per-head matrices both MLA paths need (no duplicate copy):
    ``w_uk [H, P, L]`` and ``w_uv [H, V, L]``, loaded from HF's ``kv_b_proj.weight``
    ``[H * (P + V), L]`` (rows of head h: its P key rows, then its V value rows)."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        self.w_uk = nn.Parameter(torch.empty(num_heads, qk_nope_head_dim, kv_lora_rank,
                                             dtype=dtype, device=device), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(num_heads, v_head_dim, kv_lora_rank,
                                             dtype=dtype, device=device), requires_grad=False)

    def load_kv_b(self, weight: torch.Tensor) -> None:
        expected = (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        if tuple(weight.shape) != expected:
            raise ValueError(f"kv_b_proj.weight has shape {tuple(weight.shape)}, expected {expected}")
        per_head = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        self.w_uk.copy_(per_head[:, : self.qk_nope_head_dim])
        self.w_uv.copy_(per_head[:, self.qk_nope_head_dim:])


def mla_attend_naive(q: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor | None,
                     up: MLAUpProjection, scale: float) -> torch.Tensor:
    """Up-project the context, then ordinary attention.

    q ``[n, Q, H, P+R]``, entries ``[n, S, L+R]``, mask broadcastable to ``[n, 1, Q, S]`` (bool
    or additive; None = plain causal with S == Q). Returns ``[n, Q, H, V]``."""
    n, seq_len, _ = entries.shape
    heads, nope, rank = up.num_heads, up.qk_nope_head_dim, up.kv_lora_rank
    c_kv, k_pe = entries[..., :rank], entries[..., rank:]
    k_nope = (c_kv @ up.w_uk.view(heads * nope, rank).t()).view(n, seq_len, heads, nope)
    values = (c_kv @ up.w_uv.view(-1, rank).t()).view(n, seq_len, heads, up.v_head_dim)
    keys = torch.cat([k_nope, k_pe[:, :, None].expand(n, seq_len, heads, k_pe.shape[-1])], -1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2)


def mla_attend_absorbed(q: torch.Tensor, entries: torch.Tensor, mask: torch.Tensor | None,
                        up: MLAUpProjection, scale: float) -> torch.Tensor:
    """Attention in latent space (same contract as ``mla_attend_naive``); reads only entries."""
    n, query_len, heads, _ = q.shape
    rank, nope = up.kv_lora_rank, up.qk_nope_head_dim
    # q_lat[h] = q_nope[h] @ W_UK[h]: one batched matmul over heads  [H, nQ, P] @ [H, P, L]
    q_nope = q[..., :nope].reshape(n * query_len, heads, nope).transpose(0, 1)
    q_lat = torch.bmm(q_nope, up.w_uk).transpose(0, 1).view(n, query_len, heads, rank)
    queries = torch.cat([q_lat, q[..., nope:]], -1).view(n, 1, query_len * heads, -1)
    if mask is None:
        mask = shifted_causal_mask(0, query_len, q.device)
    if query_len > 1:
        # rows are (query, head) pairs: each head row of query i gets query i's mask row
        mask = mask.repeat_interleave(heads, dim=-2)
    keys = entries[:, None]                                            # [n, 1, S, L+R]
    o_lat = F.scaled_dot_product_attention(queries, keys, keys[..., :rank], attn_mask=mask,
                                           scale=scale)                # [n, 1, Q*H, L]
    # out[h] = o_lat[h] @ W_UV[h]^T   [H, nQ, L] @ [H, L, V]
    o_lat = o_lat.view(n * query_len, heads, rank).transpose(0, 1)
    out = torch.bmm(o_lat, up.w_uv.transpose(1, 2)).transpose(0, 1)
    return out.reshape(n, query_len, heads, up.v_head_dim)


_ATTEND = {"naive": mla_attend_naive, "absorbed": mla_attend_absorbed}


@register_backend("mla")
class MLAAttentionBackend(AttentionBackend):
    """Paged MLA. Contract (differs from the K/V backends in what ``forward`` receives):

    ``forward(q, latent, up, kv_cache, meta)``: q ``[T, H, P+R]`` (rope part rotated), latent
    ``[T, L+R]`` the new tokens' cache entries (c_kv normed | k_pe rotated), ``up`` the layer's
    ``MLAUpProjection``. Writes the entries at ``meta.slot_mapping``, returns ``[T, H, V]``.
    ``decode_path`` / ``prefill_path`` pick the form per phase (defaults: absorbed / naive);
    both give the same result, which tests check by forcing each.
    """

    # gathered latent entries per decode slice (see PagedAttentionBackend.decode_gather_bytes)
    decode_gather_bytes: int = 8 * 2**20

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 decode_path: str = "absorbed", prefill_path: str = "naive") -> None:
        super().__init__(num_heads, 1, qk_nope_head_dim + qk_rope_head_dim, scale,
                         head_size_v=v_head_dim)
        for name, path in (("decode_path", decode_path), ("prefill_path", prefill_path)):
            if path not in PATHS:
                raise ValueError(f"MLA {name} {path!r} unknown; choose from {PATHS}")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.entry_size = kv_lora_rank + qk_rope_head_dim
        self.decode_path, self.prefill_path = decode_path, prefill_path

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, self.entry_size)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, up: MLAUpProjection,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self._check_inputs(q, latent, kv_cache, meta)
        slots = kv_cache[0].view(-1, self.entry_size)          # [num_blocks * block_size, L+R]
        slots.index_copy_(0, meta.slot_mapping, latent.to(kv_cache.dtype))
        bytes_per_token = self.entry_size * kv_cache.element_size()
        plans = meta.__dict__.setdefault("_mla_plans", {})
        key = (self.decode_gather_bytes, bytes_per_token, q.dtype)
        if key not in plans:
            plans[key] = _build_plan(meta, self.decode_gather_bytes, bytes_per_token, q.dtype)
        plan = plans[key]
        blocks = kv_cache[0]                                   # [num_blocks, block_size, L+R]
        out = q.new_empty(q.shape[0], self.num_heads, self.head_size_v)
        decode = _ATTEND[self.decode_path]
        for sl in plan.decode_slices:
            n = sl.end - sl.start
            entries = blocks.index_select(0, sl.block_ids).view(n, sl.padded_len, -1)
            out[sl.start:sl.end] = decode(q[sl.start:sl.end, None], entries.to(q.dtype),
                                          sl.mask, up, self.scale)[:, 0]
        prefill = _ATTEND[self.prefill_path]
        for c in plan.prefill_chunks:
            if c.block_ids is None:       # whole sequence in this step: its own new entries
                entries = latent[c.t0:c.t1]
            else:
                entries = blocks.index_select(0, c.block_ids).view(-1, self.entry_size)[:c.seq_len]
            out[c.t0:c.t1] = prefill(q[None, c.t0:c.t1], entries[None].to(q.dtype), c.mask, up,
                                     self.scale)[0]
        return out

    def _check_inputs(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata) -> None:
        num_tokens = q.shape[0]
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_size):
            raise ValueError(f"q shape {tuple(q.shape)}, expected [T, {self.num_heads}, "
                             f"{self.head_size}]")
        if latent.shape != (num_tokens, self.entry_size):
            raise ValueError(f"latent shape {tuple(latent.shape)}, expected [{num_tokens}, "
                             f"{self.entry_size}]")
        if (kv_cache.dim() != 4 or kv_cache.shape[0] != 1 or kv_cache.shape[2] != meta.block_size
                or kv_cache.shape[3] != self.entry_size):
            raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)}, expected [1, num_blocks, "
                             f"{meta.block_size}, {self.entry_size}]")
        if meta.slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} entries for "
                             f"{num_tokens} tokens")
