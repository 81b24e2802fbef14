"""Run a pure-decode step of a Llama-family model through the compiled ``DecodeStack``.

Eligible: fp32 weights on CPU, every projection an unquantized ``Linear`` (MergedLinear q|k|v and
gate|up), SwiGLU MLPs without bias, full-width NeoX rotary, the plain ``PagedAttentionBackend``
(not QUEST, windows or an fp8 cache) and a contiguous fp32 KV cache. Anything else returns None
and the model runs its Python layers, which remain the reference (tests compare the two).
"""
from __future__ import annotations

import torch

from kvforge.kernels import cpu_kernels


def build_llama_decode_stack(model):
    """A ``DecodeStack`` over ``model``'s own weight tensors, or None when not eligible."""
    from kvforge.attention.paged import PagedAttentionBackend
    from kvforge.layers.activation import GatedActivation
    from kvforge.layers.linear import UnquantizedLinearMethod
    from kvforge.models.llama import LlamaMLP

    ops = cpu_kernels()
    if ops is None or model.dtype != torch.float32:
        return None
    inner = model.model
    rotary = inner.rotary_emb
    if rotary.rotary_dim != rotary.head_dim or rotary.cos_sin_table.device.type != "cpu":
        return None
    layers, norm_eps = [], None
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(attn.attn) is not PagedAttentionBackend or type(mlp) is not LlamaMLP
                or not isinstance(mlp.act_fn, GatedActivation) or mlp.act_fn.act_name not in ("silu", "swish")):
            return None
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(type(p.method) is not UnquantizedLinearMethod for p in projections):
            return None
        if mlp.gate_up_proj.has_bias or mlp.down_proj.has_bias:
            return None
        eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps, inner.norm.eps}
        if len(eps) != 1 or (norm_eps is not None and eps != {norm_eps}):
            return None
        norm_eps = eps.pop()
        empty = torch.Tensor()
        layers.append([layer.input_layernorm.weight, attn.qkv_proj.weight,
                       attn.qkv_proj.bias if attn.qkv_proj.bias is not None else empty,
                       attn.o_proj.weight, attn.o_proj.bias if attn.o_proj.bias is not None else empty,
                       layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                       mlp.down_proj.weight])
    first = inner.layers[0].self_attn
    return ops.DecodeStack(layers, inner.norm.weight, float(norm_eps), first.num_heads,
                           first.num_kv_heads, first.head_dim, float(first.attn.scale))


def run_decode_stack(stack, model, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
    """[n] token ids of n decoding sequences -> [n, hidden] final-normed hidden states."""
    hidden = model.model.embed_tokens(input_ids)
    cos, sin = model.model.rotary_emb.cos_sin(positions)          # [n, 1, D] views
    n = input_ids.shape[0]
    return stack.forward(hidden, kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                         cos.reshape(n, -1), sin.reshape(n, -1))
