"""Mixtral: the Llama decoder (RMSNorm, RoPE attention with GQA) with every dense MLP replaced by
a sparse mixture of experts — a linear router picks the top-k of ``num_local_experts`` SwiGLU
experts per token (softmax over all experts, top-k, renormalised to sum 1).

Only the feed-forward differs from llama.py, so attention, norms, the forward loop, logits and
the cache geometry are inherited; this file adds the MoE block and the expert weight names:

    legacy HF / hub checkpoints   model.layers.N.block_sparse_moe.gate.weight          [E, H]
                                  model.layers.N.block_sparse_moe.experts.e.w1.weight  gate [I, H]
                                  model.layers.N.block_sparse_moe.experts.e.w3.weight  up   [I, H]
                                  model.layers.N.block_sparse_moe.experts.e.w2.weight  down [H, I]
    transformers >= 5 in memory   model.layers.N.mlp.gate.weight, mlp.experts.gate_up_proj
                                  [E, 2I, H], mlp.experts.down_proj [E, H, I]
Both load into ``mlp.experts`` (a ``FusedMoE`` with stacked [E, 2I, H] / [E, H, I] weights).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE
from kvforge.layers.norm import RMSNorm
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.models.config import ModelConfig
from kvforge.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

# legacy per-expert names -> our shard names (Mixtral's w1/w3/w2; Qwen2-MoE's *_proj)
_EXPERT_SHARD = {"w1": "gate", "w3": "up", "w2": "down",
                 "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_RE = re.compile(r"^(?P<moe>.+\.mlp\.experts)\.(?P<expert>\d+)\."
                        r"(?P<proj>w[123]|gate_proj|up_proj|down_proj)\.weight$")


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        hf = config.hf_config
        num_experts = hf.get("num_local_experts")
        top_k = hf.get("num_experts_per_tok")
        if not num_experts or not top_k:
            raise ValueError(f"Mixtral config needs num_local_experts and num_experts_per_tok, "
                             f"got {num_experts!r} and {top_k!r}")
        # the router is tiny ([E, H]); kept as a plain Linear so it is never quantized with experts
        self.gate = Linear(config.hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, config.intermediate_size,
                                renormalize=True, act=config.hidden_act, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its forward is inherited) with ``mlp`` = the MoE block."""

    def __init__(self, config: ModelConfig, attn_backend: str, mlp: nn.Module, dtype: torch.dtype,
                 device) -> None:
        nn.Module.__init__(self)      # not Llama's __init__: it would allocate a dense MLP
        self.self_attn = LlamaAttention(config, attn_backend, dtype, device)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class MixtralModel(nn.Module):
    """Llama's decoder stack with a per-layer feed-forward chosen by ``make_mlp`` (a family hook:
    Qwen2-MoE mixes dense and MoE layers)."""

    def __init__(self, config: ModelConfig, attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(
            MixtralDecoderLayer(config, attn_backend, self.make_mlp(config, i, dtype, device),
                                dtype, device)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_position=config.max_position_embeddings,
                                          base=config.rope_theta, rope_scaling=config.rope_scaling,
                                          dtype=dtype, device=device)

    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device) -> nn.Module:
        return MixtralSparseMoeBlock(config, dtype, device)


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # legacy checkpoints name the MoE block block_sparse_moe; ours (like transformers 5) mlp
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                             for name, tensor in weights)
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.check_loaded()
                module.process_weights_after_loading()

    def _load_one(self, name: str, tensor: torch.Tensor) -> str:
        """Expert tensors go to their FusedMoE and count as its stacked parameter (``w13``/``w2``;
        a partial load is caught by ``check_loaded``); everything else loads as in Llama."""
        match = _EXPERT_RE.match(name)
        if match:
            moe = self._get_moe(match["moe"], name)
            shard = _EXPERT_SHARD[match["proj"]]
            moe.load_expert_weight(int(match["expert"]), shard, tensor)
            return f"{match['moe']}.{'w2' if shard == 'down' else 'w13'}"
        moe_path, _, kind = name.rpartition(".")
        if moe_path.endswith(".mlp.experts") and kind in ("gate_up_proj", "down_proj"):
            self._get_moe(moe_path, name).load_stacked(kind, tensor)
            return f"{moe_path}.{'w2' if kind == 'down_proj' else 'w13'}"
        return super()._load_one(name, tensor)

    def _get_moe(self, path: str, name: str) -> FusedMoE:
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE):
            raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
        return module
