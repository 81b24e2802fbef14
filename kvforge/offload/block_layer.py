"""A decoder layer run on a block's rows: the norms and dense projections over all rows in one
call each, the attention however the caller splits it (per batch on the KV staged for that
batch, or over all rows on the RAM pool).

On CPU the block's activations are in RAM anyway, and an fp32 GEMM on 8 rows costs ~3x per row
what it costs on 128 (the weights are read from memory once per call either way), so running
the projections batch by batch, as FlexGen's GPU batch does, would leave most of that on the
table."""
from __future__ import annotations

import torch

from kvforge.attention.base import Attend


def block_layer_forward(layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary,
                        cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama decoder layer on all of ``hidden``'s rows, with ``attend(q, k, v)`` (the rows'
    attention output, [T, heads, head_dim]) in place of the layer's own attention call: the
    norms and projections see every row at once however the attention is split."""
    if residual is None:
        residual, x = hidden, layer.input_layernorm(hidden)
    else:
        x, residual = layer.input_layernorm(hidden, residual)
    attn = layer.self_attn
    q, k, v = attn.rotated_qkv(x, rotary, cos, sin)
    x = attn.o_proj(attend(q, k, v).reshape(x.shape[0], attn.q_size))
    x, residual = layer.post_attention_layernorm(x, residual)
    return layer.mlp(x), residual
