"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) with a feed-forward
that adds an always-on shared expert to the routed experts:

    out = sum_topk w_e * expert_e(x)  +  sigmoid(shared_expert_gate(x)) * shared_expert(x)

Routing is softmax then top-k, renormalised only when ``norm_topk_prob``. Layers listed in
``mlp_only_layers`` (or not on the ``decoder_sparse_step`` grid) keep a dense SwiGLU MLP of
``intermediate_size``; experts use ``moe_intermediate_size``, the shared expert
``shared_expert_intermediate_size`` (0: none). Everything else, weight names included
(``mlp.experts.e.gate_proj`` etc. or transformers-5 stacked tensors), is Mixtral's code path.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvforge.layers.linear import Linear
from kvforge.layers.moe import FusedMoE
from kvforge.models.config import ModelConfig
from kvforge.models.llama import LlamaMLP
from kvforge.models.mixtral import MixtralForCausalLM, MixtralModel


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        num_experts = hf["num_experts"]
        self.gate = Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        self.experts = FusedMoE(num_experts, hf["num_experts_per_tok"], hidden,
                                hf["moe_intermediate_size"],
                                renormalize=bool(hf.get("norm_topk_prob", False)),
                                act=config.hidden_act, dtype=dtype, device=device)
        shared_size = hf.get("shared_expert_intermediate_size") or 0
        self.shared_expert = self.shared_expert_gate = None
        if shared_size:
            self.shared_expert = LlamaMLP(dataclasses.replace(config, intermediate_size=shared_size),
                                          dtype, device)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out


class Qwen2MoeModel(MixtralModel):
    @staticmethod
    def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device) -> nn.Module:
        hf = config.hf_config
        step = hf.get("decoder_sparse_step", 1) or 1
        sparse = (layer_idx not in (hf.get("mlp_only_layers") or [])
                  and hf.get("num_experts", 0) > 0 and (layer_idx + 1) % step == 0)
        return Qwen2MoeSparseMoeBlock(config, dtype, device) if sparse else LlamaMLP(config, dtype, device)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    model_cls = Qwen2MoeModel

    def __init__(self, config: ModelConfig, attn_backend: str = "paged",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if not config.hf_config.get(key):
                raise ValueError(f"Qwen2-MoE config needs {key} > 0, got "
                                 f"{config.hf_config.get(key)!r}")
        # q/k/v always carry biases in Qwen2-MoE (transformers 5 spells it qkv_bias)
        config = dataclasses.replace(config, attention_bias=bool(config.hf_config.get("qkv_bias", True)))
        super().__init__(config, attn_backend, dtype, device)

