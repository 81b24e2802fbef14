"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM): pre-norm blocks of
RMSNorm -> attention with RoPE -> RMSNorm -> SwiGLU MLP, residual adds fused into the norms.

Differences between the members are config flags, not code paths:
  - q/k/v biases: ``attention_bias`` (Qwen2 always; Llama's flag also adds an o_proj bias)
  - ``head_dim`` may differ from hidden_size / num_heads
  - tied or separate ``lm_head``; rope_scaling default / linear / llama3 (see layers/rotary.py)
  - sliding window (Mistral, Qwen2 with use_sliding_window): not here; after loading,
    ``attention/window_setup.py`` gives the windowed layers a ``WindowedAttentionBackend``.
Module names follow HF so checkpoint names map directly; q/k/v load into one ``qkv_proj`` and
gate/up into one ``gate_up_proj`` (one matmul each instead of three / two).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvforge.attention.base import Attend, get_backend_cls
from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels.decode_stack import build_llama_decode_stack
from kvforge.layers.embedding import uninitialized_embedding
from kvforge.layers.activation import GatedActivation
from kvforge.layers.linear import Linear, MergedLinear, UnquantizedLinearMethod
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary import RotaryEmbedding, cos_sin_rows
from kvforge.models.base import (RotaryDecoderLMMixin, copy_plain_parameter, expected_weight_keys,
                                 finish_loading)
from kvforge.models.compiled_decode import CompiledDecodeMixin
from kvforge.models.config import ModelConfig

# HF checkpoint projection -> (our fused module, shard index within it)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Families whose attention_bias covers q/k/v only (HF Llama's flag also biases o_proj)
_QKV_ONLY_BIAS = {"Qwen2ForCausalLM", "qwen2", "Qwen2MoeForCausalLM"}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=config.attention_bias, dtype=dtype, device=device)
        o_bias = config.attention_bias and config.architecture not in _QKV_ONLY_BIAS
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias, dtype=dtype, device=device)
        self.attn = get_backend_cls(attn_backend)(self.num_heads, self.num_kv_heads, self.head_dim,
                                                  scale=self.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.rotated_qkv(hidden, rotary, cos, sin)
        out = self.attn.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))

    def forward_attending(self, hidden: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor,
                          sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``forward`` with ``attend(q, k, v)`` (the rows' attention output, [T, H, D]) in
        place of the backend's call on the paged cache: kvforge/offload attends per batch on
        the KV it staged for that batch."""
        q, k, v = self.rotated_qkv(hidden, rotary, cos, sin)
        return self.o_proj(attend(q, k, v).reshape(hidden.shape[0], self.q_size))

    def rotated_qkv(self, hidden: torch.Tensor, rotary: RotaryEmbedding, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) of ``hidden``, q and k rotated: what the
        attention backend takes (kvforge/offload runs it on a block's rows in one call and the
        attention on each batch's rows)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # qkv row: [ q (H heads) | k (KVH heads) | v (KVH heads) ]; q and k are rotated together
        # as one [T, H + KVH, D] view, so RoPE costs one set of ops per layer, not two
        qk = rotary.apply(qkv[:, : self.q_size + self.kv_size]
                          .view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim),
                          cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        if config.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be > 0, got {config.intermediate_size}")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=config.mlp_bias,
                                         dtype=dtype, device=device)
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias, dtype=dtype,
                                device=device)
        self.act_fn = GatedActivation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, hidden, residual, rotary, cos, sin, kv_cache, meta):
        return self._around_attention(
            hidden, residual, lambda x: self.self_attn(x, rotary, cos, sin, kv_cache, meta))

    def forward_attending(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                          rotary: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                          attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the attention taken as a call (``LlamaAttention.forward_attending``;
        Llama attention only, not DeepSeek-V2's MLA subclass). kvforge/offload runs a block's
        rows through it: the norms and projections over every row in one call each, the
        attention per batch on that batch's staged KV (on CPU an fp32 GEMM on 8 rows costs ~3x
        per row what it costs on 128, so projecting batch by batch, as FlexGen's GPU batch
        does, would leave that on the table)."""
        return self._around_attention(
            hidden, residual,
            lambda x: self.self_attn.forward_attending(x, rotary, cos, sin, attend))

    def _around_attention(self, hidden, residual, attention):
        # the residual stream is carried separately and added inside the next norm:
        # residual = hidden + residual; hidden = norm(residual)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(attention(hidden), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size,
                                                    dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attn_backend, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_position=config.max_position_embeddings,
                                          base=config.rope_theta, rope_scaling=config.rope_scaling,
                                          dtype=dtype, device=device)


def llama_stack(model, what: str) -> LlamaModel:
    """``model.model`` when it is a Llama-family decoder stack (what callers that run its layers
    one by one need: embeddings, layers, final norm, rotary); else ValueError naming ``what``."""
    stack = getattr(model, "model", None)
    if stack is None or not all(hasattr(stack, a)
                                for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise ValueError(f"{what} needs a Llama-family decoder stack, got {type(model).__name__}")
    return stack


class LlamaForCausalLM(CompiledDecodeMixin, RotaryDecoderLMMixin, nn.Module):
    # the decoder stack; a family that differs only inside its layers (Mixtral's MoE) swaps it
    model_cls: type[nn.Module] = LlamaModel

    def __init__(self, config: ModelConfig, attn_backend: str = "paged",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.dtype = dtype
        self.model = self.model_cls(config, attn_backend, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                              device=device)
        # tied: a plain LM head reads the embedding tensor itself (no second vocab x hidden copy);
        # a quantized head would keep its own weights, loaded from the embedding
        self._head_shares_embedding = (config.tie_word_embeddings and
                                       isinstance(self.lm_head.method, UnquantizedLinearMethod))
        if self._head_shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight
        # inference only: no autograd bookkeeping on any op
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        # a decode step runs in one compiled call when the model qualifies; otherwise, and as
        # the reference, the Python layers
        hidden = self._stack_forward(input_ids, positions, kv_caches, meta)
        if hidden is not None:
            return hidden
        return super().forward(input_ids, positions, kv_caches, meta)

    # the compiled decode stack's hooks (models/compiled_decode.py)
    def _build_decode_stack(self):
        return build_llama_decode_stack(self)

    def _stack_step_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.model.rotary_emb.cos_sin(positions)          # [T, 1, D] views
        num_tokens = input_ids.shape[0]
        return (self.model.embed_tokens(input_ids),
                (cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)))

    def _stack_rope_tables(self, positions: torch.Tensor, num_steps: int):
        rotary = self.model.rotary_emb
        table = rotary.cos_sin_table
        first, last = int(positions.min()), int(positions.max()) + num_steps - 1
        if last < table.shape[0]:
            return table, None, 0
        # past the table (StreamingLLM beyond the context: layers/rotary_unbounded.py): the
        # rows of the positions the call reaches
        return cos_sin_rows(rotary, first, last, positions.device), None, first

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises ValueError on an unknown name, a bad shape, or a
        parameter left unloaded (``lm_head.weight`` comes from the embedding when tied)."""
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue            # stale buffer in old checkpoints; we compute our own
            if name == "lm_head.weight" and tied:
                continue            # some tied checkpoints store a copy; the embedding wins
            if name == "model.embed_tokens.weight" and tied:
                if not self._head_shares_embedding:
                    self.lm_head.load_weight("weight", tensor)
                loaded.add("lm_head.weight")
            loaded.add(self._load_one(name, tensor))
        finish_loading(self, expected_weight_keys(self), loaded)

    def _load_one(self, name: str, tensor: torch.Tensor) -> str:
        module_path, _, kind = name.rpartition(".")
        parent_path, _, leaf = module_path.rpartition(".")
        try:
            if leaf in _STACKED:
                fused_name, shard = _STACKED[leaf]
                fused_path = f"{parent_path}.{fused_name}"
                self.get_submodule(fused_path).load_shard(shard, kind, tensor)
                return f"{fused_path}.{kind}#{shard}"
            module = self.get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}") from None
        if isinstance(module, Linear):
            module.load_weight(kind, tensor)
        else:
            copy_plain_parameter(module, kind, name, tensor, self.config.architecture)
        return name
