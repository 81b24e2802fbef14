"""DeepSeek-V2 decoder: multi-head latent attention (MLA) + DeepSeek-MoE feed-forward.

Attention of one layer (H heads; P/R/V = qk_nope / qk_rope / v head dims; L = kv_lora_rank)::

    hidden ─► q_proj  (or q_a_proj ─► q_a_layernorm ─► q_b_proj)  ─► q [T, H, P | R]
    hidden ─► kv_a_proj_with_mqa ─► [c (L) | k_pe (R)] ; c ─► kv_a_layernorm
              rotate q's R part and k_pe (interleaved RoPE, layers/rotary_interleaved.py)
    cache entry per token = [c | k_pe]  (L + R values, one "head": attention/mla.py)
    kv_b_proj [H * (P + V), L] = the per-head up-projections W_UK / W_UV of c, never a K/V cache
    softmax scale = (P + R) ** -0.5  (times mscale^2 for yarn with mscale_all_dim, unsupported)

Layers ``>= first_k_dense_replace`` (and ``% moe_layer_freq == 0``) use DeepSeek-MoE
(models/deepseek_moe.py), the others a dense SwiGLU MLP. Norms, residuals and the head are
Llama's. Module names follow HF so checkpoint names map directly.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla import MLAAttentionBackend, MLAUpProjection
from kvforge.layers.embedding import uninitialized_embedding
from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary_interleaved import InterleavedRotaryEmbedding
from kvforge.models.base import (RotaryDecoderLMMixin, copy_plain_parameter, expected_weight_keys,
                                 finish_loading)
from kvforge.models.config import ModelConfig
from kvforge.models.deepseek_moe import DeepseekMoE, DeepseekMoEConfig
from kvforge.models.llama import LlamaDecoderLayer, LlamaMLP

# HF reference uses RMSNorm's default eps for the two low-rank norms, not rms_norm_eps
LORA_NORM_EPS = 1e-6
# names the engine's default backend choice may carry; MLA's latent cache needs its own backend
_ACCEPTED_BACKENDS = ("mla", "paged")
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MERGED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV2Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        d = config.hf_config
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = d.get("q_lora_rank")
        self.kv_lora_rank = d["kv_lora_rank"]
        self.nope_dim, self.rope_dim = d["qk_nope_head_dim"], d["qk_rope_head_dim"]
        self.v_head_dim = d["v_head_dim"]
        hidden, bias = config.hidden_size, config.attention_bias
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        kw = dict(dtype=dtype, device=device)
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, **kw)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS, **kw)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, **kw)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS, **kw)
        self.kv_b_proj = MLAUpProjection(self.num_heads, self.kv_lora_rank, self.nope_dim,
                                         self.v_head_dim, **kw)
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias=bias, **kw)
        self.attn = MLAAttentionBackend(self.num_heads, self.kv_lora_rank, self.nope_dim,
                                        self.rope_dim, self.v_head_dim,
                                        scale=(self.nope_dim + self.rope_dim) ** -0.5)

    def forward(self, hidden: torch.Tensor, rotary: InterleavedRotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q = torch.cat([q[..., :self.nope_dim], rotary.apply(q[..., self.nope_dim:], cos, sin)], -1)
        kv_a = self.kv_a_proj_with_mqa(hidden)
        c_kv = self.kv_a_layernorm(kv_a[:, :self.kv_lora_rank])
        k_pe = rotary.apply(kv_a[:, None, self.kv_lora_rank:], cos, sin)[:, 0]
        latent = torch.cat([c_kv, k_pe], -1)                       # the token's cache entry
        out = self.attn.forward(q, latent, self.kv_b_proj, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual wiring (its ``forward``) around MLA and a dense or MoE MLP."""

    def __init__(self, config: ModelConfig, moe: DeepseekMoEConfig | None, layer_idx: int,
                 dtype: torch.dtype, device) -> None:
        nn.Module.__init__(self)      # own sub-modules; only the forward is shared
        self.self_attn = DeepseekV2Attention(config, dtype, device)
        if moe is not None and moe.is_moe_layer(layer_idx):
            self.mlp = DeepseekMoE(config, moe, dtype, device)
        else:
            self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class DeepseekV2Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        moe = DeepseekMoEConfig.from_hf(config.hf_config)
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size,
                                                    dtype, device)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, moe, i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = InterleavedRotaryEmbedding(
            config.hf_config["qk_rope_head_dim"], max_position=config.max_position_embeddings,
            base=config.rope_theta, rope_scaling=config.rope_scaling, dtype=dtype, device=device)


class DeepseekV2ForCausalLM(RotaryDecoderLMMixin, nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: str = "mla",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                   if not config.hf_config.get(k)]
        if missing:
            raise ValueError(f"DeepSeek-V2 config lacks MLA fields {missing}")
        if attn_backend not in _ACCEPTED_BACKENDS:
            raise ValueError(f"DeepSeek-V2 attention runs on the 'mla' latent-cache backend; "
                             f"attention_backend {attn_backend!r} cannot serve it")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.dtype = dtype
        self.model = DeepseekV2Model(config, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype, device=device)
        self.requires_grad_(False)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (per-expert or transformers-5 stacked experts); ValueError on an
        unknown name, a bad shape, or a parameter left unloaded."""
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied):
                continue
            if name == "model.embed_tokens.weight" and tied:
                self.lm_head.load_weight("weight", tensor)
                loaded.add("lm_head.weight")
            loaded.add(self._load_one(name, tensor))
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.check_loaded()
                module.process_weights_after_loading()
        finish_loading(self, self._expected_weights(), loaded)

    def _expected_weights(self) -> set[str]:
        def claim(name, module):
            if isinstance(module, FusedMoE):
                return {f"{name}#experts"}          # completeness: FusedMoE.check_loaded
            if isinstance(module, MLAUpProjection):
                return {f"{name}.weight"}
            return None
        return expected_weight_keys(self, claim)

    def _load_one(self, name: str, tensor: torch.Tensor) -> str:
        """Route one checkpoint tensor; returns the key it fills in ``_expected_weights``."""
        try:
            if m := _EXPERT.match(name):
                self.get_submodule(m[1]).load_expert_weight(int(m[2]), m[3], tensor)
                return f"{m[1]}#experts"
            if m := _STACKED_EXPERTS.match(name):
                self.get_submodule(m[1]).load_stacked(m[2], tensor)
                return f"{m[1]}#experts"
            module_path, _, kind = name.rpartition(".")
            parent_path, _, leaf = module_path.rpartition(".")
            if leaf in _MERGED:
                fused_path = f"{parent_path}.{_MERGED[leaf][0]}"
                self.get_submodule(fused_path).load_shard(_MERGED[leaf][1], kind, tensor)
                return f"{fused_path}.{kind}#{_MERGED[leaf][1]}"
            module = self.get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}") from None
        if isinstance(module, MLAUpProjection) and kind == "weight":
            module.load_kv_b(tensor)
        elif isinstance(module, Linear):
            module.load_weight(kind, tensor)
        else:
            copy_plain_parameter(module, kind, name, tensor, self.config.architecture)
        return name
