"""Mixture-of-experts feed-forward: route each token to its top-k experts, run every active
expert ONCE over all of its tokens, and add the weighted results back per token.

Pieces (use them separately or through ``FusedMoE``):

- ``select_experts(router_logits, top_k, renormalize)`` -> ``(topk_weights [T, k] float32,
  topk_ids [T, k] int64)``: softmax over ALL experts in fp32, then top-k; with ``renormalize``
  (Mixtral; Qwen2-MoE / DeepSeek when ``norm_topk_prob``) the k weights are divided by their
  sum, otherwise they keep their share of the full softmax.
- ``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, act)``: the routed
  experts of one layer. ``forward(hidden [T, H], router_logits [T, E]) -> [T, H]``. The router
  (``gate``) and any shared expert stay in the model, since families differ there.
- ``ExpertsMethod``: how the stacked expert weights are stored and multiplied. The plain method
  keeps ``w13`` [E, 2*I, H] (each expert's gate rows then up rows, HF [out, in] layout) and
  ``w2`` [E, H, I]; a weight-only INT8 method replaces it, like ``LinearMethod`` for dense layers.

Grouping by expert (no per-token Python loop; one host sync for the per-expert counts)::

    topk_ids  [[2, 0],            flat pairs (token, expert):  (0,2) (0,0) (1,1) (1,2) (2,0) (2,2)
               [1, 2],            stable sort by expert id ->  (0,0) (2,0) | (1,1) | (0,2) (1,2) (2,2)
               [0, 2]]            counts per expert         ->   2          1        3
    expert e runs one GEMM over its contiguous slice of the sorted rows; each result row is
    scaled by its routing weight and ``index_add_``-ed back into its token's output row.

Loading: ``load_expert_weight(expert_id, shard, tensor)`` takes one HF per-expert tensor
(``shard`` "gate" | "up" | "down", i.e. Mixtral's w1 | w3 | w2, Qwen2-MoE's gate_proj | up_proj |
down_proj); ``load_stacked(kind, tensor)`` takes transformers-5 fused ``gate_up_proj`` [E, 2I, H]
/ ``down_proj`` [E, H, I] tensors. ``check_loaded()`` raises if an expert shard never arrived.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from kvforge.layers.activation import GatedActivation

EXPERT_SHARDS = ("gate", "up", "down")


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax-then-top-k routing. Returns fp32 weights [T, k] and int64 expert ids [T, k]."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, num_experts], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts={router_logits.shape[1]}]")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertsMethod(ABC):
    """Contract: ``create_weights`` registers the stacked expert parameters on the layer;
    ``load_expert`` copies one expert's HF [out, in] tensor into rows ``[row_offset, +n)`` of
    the stacked ``w13`` (shard "gate"/"up") or into ``w2`` (shard "down");
    ``process_weights_after_loading`` runs once after every expert is loaded (e.g. to quantize);
    ``expert_forward(layer, e, x)`` returns expert ``e``'s MLP output for rows ``x`` [n, H]."""

    @abstractmethod
    def create_weights(self, layer: "FusedMoE", dtype: torch.dtype, device) -> None: ...

    @abstractmethod
    def load_expert(self, layer: "FusedMoE", expert_id: int, shard: str,
                    loaded: torch.Tensor) -> None: ...

    def process_weights_after_loading(self, layer: "FusedMoE") -> None:
        pass

    @abstractmethod
    def expert_forward(self, layer: "FusedMoE", expert_id: int, x: torch.Tensor) -> torch.Tensor: ...


def check_expert_shape(layer: "FusedMoE", expert_id: int, shard: str, loaded) -> None:
    """One expert's HF tensor must be [I, H] (gate / up) or [H, I] (down)."""
    h, i = layer.hidden_size, layer.intermediate_size
    expected = (h, i) if shard == "down" else (i, h)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"expert {expert_id} {shard} weight has shape {tuple(loaded.shape)}, "
                         f"expected {expected}")


class UnquantizedExpertsMethod(ExpertsMethod):
    """Float ``w13`` [E, 2I, H] and ``w2`` [E, H, I]; ``x @ w13[e].T`` -> act -> ``@ w2[e].T``."""

    def create_weights(self, layer, dtype, device):
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device),
                                 requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device),
                                requires_grad=False)

    def load_expert(self, layer, expert_id, shard, loaded):
        check_expert_shape(layer, expert_id, shard, loaded)
        i = layer.intermediate_size
        if shard == "down":
            layer.w2[expert_id].copy_(loaded)
        else:
            offset = 0 if shard == "gate" else i       # w13 rows: [gate (I) | up (I)]
            layer.w13[expert_id, offset:offset + i].copy_(loaded)

    def expert_forward(self, layer, expert_id, x):
        return layer.act_fn(x @ layer.w13[expert_id].t()) @ layer.w2[expert_id].t()


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, act: str = "silu", method: ExpertsMethod | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if value <= 0:
                raise ValueError(f"FusedMoE {name} must be > 0, got {value}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"FusedMoE top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.act_fn = GatedActivation(act)
        self.method = method or UnquantizedExpertsMethod()
        self.method.create_weights(self, dtype, device)
        self._loaded: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ weights
    def load_expert_weight(self, expert_id: int, shard: str, loaded: torch.Tensor) -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range for {self.num_experts} experts")
        if shard not in EXPERT_SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}; expected one of {EXPERT_SHARDS}")
        self.method.load_expert(self, expert_id, shard, loaded)
        self._loaded.add((expert_id, shard))

    def load_stacked(self, kind: str, loaded: torch.Tensor) -> None:
        """transformers-5 fused tensors: ``gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I]."""
        if kind not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"unknown stacked expert tensor {kind!r}")
        if loaded.dim() != 3 or loaded.shape[0] != self.num_experts:
            raise ValueError(f"stacked {kind} has shape {tuple(loaded.shape)}, expected "
                             f"[{self.num_experts}, ...]")
        i = self.intermediate_size
        for e in range(self.num_experts):
            if kind == "down_proj":
                self.load_expert_weight(e, "down", loaded[e])
            else:
                self.load_expert_weight(e, "gate", loaded[e, :i])
                self.load_expert_weight(e, "up", loaded[e, i:])

    def check_loaded(self) -> None:
        missing = [(e, s) for e in range(self.num_experts) for s in EXPERT_SHARDS
                   if (e, s) not in self._loaded]
        if missing:
            raise ValueError(f"expert weights never loaded (expert, shard): {missing[:6]}")

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if router_logits.shape != (num_tokens, self.num_experts):
            raise ValueError(f"router_logits shape {tuple(router_logits.shape)}, expected "
                             f"[{num_tokens}, {self.num_experts}]")
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.experts_forward(hidden, weights, ids)

    def experts_forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for every token t."""
        flat_ids = topk_ids.reshape(-1)                               # [T * k] pair -> expert
        order = torch.argsort(flat_ids, stable=True)                  # pairs grouped by expert
        token_of_row = order // self.top_k                            # sorted row -> its token
        row_weights = topk_weights.reshape(-1)[order].to(hidden.dtype)[:, None]
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()   # one host sync
        rows = hidden.index_select(0, token_of_row)                  # [T * k, H] sorted by expert
        expert_out = torch.empty_like(rows)
        start = 0
        for expert_id, n in enumerate(counts):
            if n:
                expert_out[start:start + n] = self.method.expert_forward(
                    self, expert_id, rows[start:start + n])
                start += n
        out = torch.zeros_like(hidden)
        return out.index_add_(0, token_of_row, expert_out.mul_(row_weights))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, "
                f"method={type(self.method).__name__}")
