"""DeepSeek-MoE feed-forward (DeepSeek-V2): routed experts chosen per token plus always-on
shared experts.

    hidden ──► gate (fp32 linear) ──► softmax over all experts ──► top-k ──► weights
       │                                 (greedy, or group_limited_greedy: keep the top
       │                                  ``topk_group`` of ``n_group`` expert groups first)
       ├──► routed experts (FusedMoE, tokens grouped by expert) × weights ─┐
       └──► shared experts (one SwiGLU MLP of n_shared × moe_intermediate) ─┴─► sum

Weights after top-k follow the original DeepSeek-V2 code: with ``norm_topk_prob`` (and k > 1)
they are divided by their sum, otherwise multiplied by ``routed_scaling_factor``. HF
transformers 5 ignores ``norm_topk_prob`` and always multiplies; every released V2 checkpoint
has ``norm_topk_prob: false``, where the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.moe import FusedMoE
from kvforge.models.config import ModelConfig
from kvforge.models.llama import LlamaMLP

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass
class DeepseekMoEConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"

    def __post_init__(self) -> None:
        if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) and moe_intermediate_size "
                             f"({self.moe_intermediate_size}) must be > 0")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, n_routed_experts={self.n_routed_experts}]")
        if self.moe_layer_freq <= 0:
            raise ValueError(f"moe_layer_freq must be > 0, got {self.moe_layer_freq}")
        if self.scoring_func != "softmax":
            raise ValueError(f"DeepSeek-V2 scoring_func {self.scoring_func!r} unsupported; "
                             f"only 'softmax'")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} unsupported; use one of {TOPK_METHODS}")
        if self.topk_method == "group_limited_greedy":
            if not self.n_group or not self.topk_group or self.n_routed_experts % self.n_group:
                raise ValueError(f"group_limited_greedy needs n_group dividing n_routed_experts "
                                 f"({self.n_routed_experts}) and topk_group, got n_group="
                                 f"{self.n_group}, topk_group={self.topk_group}")
            if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DeepseekMoEConfig | None":
        """None for a dense model (no routed experts)."""
        if not d.get("n_routed_experts"):
            return None
        return cls(n_routed_experts=d["n_routed_experts"],
                   num_experts_per_tok=d.get("num_experts_per_tok") or 1,
                   moe_intermediate_size=d["moe_intermediate_size"],
                   n_shared_experts=d.get("n_shared_experts") or 0,
                   first_k_dense_replace=d.get("first_k_dense_replace") or 0,
                   moe_layer_freq=d.get("moe_layer_freq") or 1,
                   routed_scaling_factor=d.get("routed_scaling_factor") or 1.0,
                   norm_topk_prob=bool(d.get("norm_topk_prob")),
                   topk_method=d.get("topk_method") or "greedy",
                   n_group=d.get("n_group"), topk_group=d.get("topk_group"),
                   scoring_func=d.get("scoring_func") or "softmax")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


def deepseek_route(scores: torch.Tensor, cfg: DeepseekMoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] (softmax probabilities, fp32) -> (weights [T, k] fp32, expert ids [T, k])."""
    if cfg.topk_method == "group_limited_greedy":
        num_tokens, per_group = scores.shape[0], cfg.n_routed_experts // cfg.n_group
        # a group's score is its best expert; experts outside the top groups are zeroed
        group_scores = scores.view(num_tokens, cfg.n_group, per_group).amax(-1)
        top_groups = torch.topk(group_scores, cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        scores = scores.masked_fill(~keep.repeat_interleave(per_group, dim=1), 0.0)
    weights, ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, moe: DeepseekMoEConfig, dtype: torch.dtype,
                 device) -> None:
        super().__init__()
        self.moe_config = moe
        self.experts = FusedMoE(moe.n_routed_experts, moe.num_experts_per_tok, config.hidden_size,
                                moe.moe_intermediate_size, renormalize=False,
                                act=config.hidden_act, dtype=dtype, device=device)
        # the router stays fp32 whatever the model dtype, as in the reference implementation
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(moe.n_routed_experts, config.hidden_size,
                                                    dtype=torch.float32, device=device),
                                        requires_grad=False)
        self.shared_experts = None
        if moe.n_shared_experts:
            shared = replace(config, intermediate_size=moe.moe_intermediate_size * moe.n_shared_experts)
            self.shared_experts = LlamaMLP(shared, dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(F.linear(hidden.float(), self.gate.weight), dim=-1)
        weights, ids = deepseek_route(scores, self.moe_config)
        out = self.experts.experts_forward(hidden, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
