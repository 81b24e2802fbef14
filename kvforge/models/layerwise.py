"""A decoder run one layer at a time, by code outside the model's own forward: what each
family must say for that (offload/streamed_model.py streams the layers from disk; early exit,
self-draft and exit-head training stop after some of them). Per family: how an embedding row
becomes a layer input, which RoPE a layer takes, the layer on a block of rows with the
attention left to the caller, the final norm and the logits. (The K/V a layer caches for a
given residual stream is one call for both: its input norm, then its attention's
``rotated_qkv``; ``CachedLayers.stream_kv``.)

    Llama family (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE)   Gemma 3
      h = embedding row                                          h = row * sqrt(hidden)
      one RoPE                                                   local RoPE on sliding layers,
                                                                 global on full ones
      x = norm(h + r); r = h + r (fused add + norm)              x = h + post_attn(attn(in(h)))
      ...                                                        h = x + post_ffn(mlp(pre_ffn(x)))
      stream after a layer = h + r                               stream after a layer = h
      out = norm(h + r)                                          out = norm(h) (weight 1 + w);
                                                                 logits soft-capped

A caller carries (hidden, residual) between layers; residual is None for Gemma 3, whose layers
add their own residual, so ``stream_of`` and ``set_stream`` serve both. The layers' own windows
(Gemma 3's sliding layers, Mistral's) live in their attention backends, which the caller's
``attend`` runs, so a family does not see them."""
from __future__ import annotations

import torch

from kvforge.attention.base import Attend


class LlamaLayerwise:
    name = "Llama family"

    def embed(self, model, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def rotaries(self, model) -> list:
        return [model.rotary_emb]

    def rotary(self, model, j: int):
        return model.rotary_emb

    def cos_sin(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary.cos_sin(positions)            # its table is in the model's dtype

    def layer_forward(self, layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary,
                      cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.forward_attending(hidden, residual, rotary, cos, sin, attend)

    def final_norm(self, model, hidden: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return model.norm(hidden, residual)[0]

    def final_norm_scale(self, model) -> torch.Tensor:
        """The final RMSNorm's multiplier (what an exit head's norm starts from)."""
        return model.norm.weight.detach().float()

    def logits(self, skeleton, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Gemma3Layerwise:
    name = "Gemma 3"

    def embed(self, model, rows: torch.Tensor) -> torch.Tensor:
        return rows * model.embed_scale

    def rotaries(self, model) -> list:
        return [model.rotary_local, model.rotary_global]

    def rotary(self, model, j: int):
        from kvforge.models.gemma3 import SLIDING
        return model.rotary_local if model.layers[j].layer_type == SLIDING else model.rotary_global

    def cos_sin(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        return rotary.cos_sin(positions, dtype)

    def layer_forward(self, layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary,
                      cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                      ) -> tuple[torch.Tensor, None]:
        return layer.forward_attending(hidden, rotary, cos, sin, attend), None

    def final_norm(self, model, hidden: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return model.norm(hidden)

    def final_norm_scale(self, model) -> torch.Tensor:
        return 1.0 + model.norm.weight.detach().float()     # stored zero-centred, as HF's

    def logits(self, skeleton, logits: torch.Tensor) -> torch.Tensor:
        return skeleton.cap_logits(logits)


def layerwise_family(model_class: type, what: str = "offloading"):
    """The family adapter of a model class; ValueError naming ``what`` and the class where a
    layer-by-layer run would compute it wrong (GPT-2's learned positions, DeepSeek-V2's latent
    attention)."""
    from kvforge.models.gemma3 import Gemma3ForCausalLM
    from kvforge.models.llama import LlamaForCausalLM
    if issubclass(model_class, Gemma3ForCausalLM):
        return Gemma3Layerwise()
    if issubclass(model_class, LlamaForCausalLM):
        return LlamaLayerwise()
    raise ValueError(f"{what} runs Llama-family decoders (Llama, Mistral, Qwen2, Mixtral, "
                     f"Qwen2-MoE) and Gemma 3 layer by layer; {model_class.__name__} is not "
                     f"supported")


def stream_of(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The residual stream after a layer (what an exit head or the final norm reads)."""
    return hidden if residual is None else hidden + residual


def set_stream(hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor,
               stream: torch.Tensor) -> None:
    """Make ``rows``' stream ``stream`` for the next layer, in place (Llama: the residual
    holds it and the layer output to add is zero)."""
    if residual is None:
        hidden[rows] = stream
    else:
        hidden[rows] = 0
        residual[rows] = stream


class CachedLayers:
    """The layers of ``model`` (a family's) on the paged cache, one call per layer: what early
    exit, self-draft and exit-head training run instead of the model's whole forward."""

    def __init__(self, model, what: str) -> None:
        self.family = layerwise_family(type(model), what)
        self.model = model
        self.stack = model.model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.family.embed(self.stack, self.stack.embed_tokens(input_ids))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple]:
        """Per layer (rotary, cos, sin), each table computed once per RoPE."""
        tables = {id(r): (r, *self.family.cos_sin(r, positions, dtype))
                  for r in self.family.rotaries(self.stack)}
        return [tables[id(self.family.rotary(self.stack, j))]
                for j in range(len(self.stack.layers))]

    def layer(self, j: int, hidden: torch.Tensor, residual: torch.Tensor | None, rope: tuple,
              kv_cache: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = self.stack.layers[j]
        backend = layer.self_attn.attn        # the layer's own (windowed, QUEST, ...) backend
        return self.family.layer_forward(layer, hidden, residual, *rope,
                                         lambda q, k, v: backend.forward(q, k, v, kv_cache, meta))

    def stream_kv(self, j: int, stream: torch.Tensor, rope: tuple
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(K rotated, V) layer j caches for rows whose residual stream is ``stream``: its
        input norm, then its attention's own q|k|v path (Gemma 3: k normed per head)."""
        layer = self.stack.layers[j]
        _, k, v = layer.self_attn.rotated_qkv(layer.input_layernorm(stream), *rope)
        return k, v

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.family.final_norm(self.stack, hidden, residual)
