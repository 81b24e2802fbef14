"""What the streamed forward (streamed_model.py, layer_timing.py) needs of a model family: how a
row of the embedding becomes a layer input, which RoPE a layer takes, a decoder layer on a
block's rows with the attention left to the caller, the final norm and the logits.

    Llama family (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE)   Gemma 3
      h = embedding row                                          h = row * sqrt(hidden)
      one RoPE                                                   local RoPE on sliding layers,
                                                                 global on full ones
      x = norm(h + r); r = h + r (fused add + norm)              x = h + post_attn(attn(in(h)))
      ...                                                        h = x + post_ffn(mlp(pre_ffn(x)))
      out = norm(h + r)                                          out = norm(h); logits softcapped

The layers' own windows (Gemma 3's sliding layers) live in their attention backends, which the
caller's ``attend`` runs, so a family does not see them."""
from __future__ import annotations

import torch

from kvforge.attention.base import Attend


class LlamaStreaming:
    name = "Llama family"

    def embed(self, model, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def rotaries(self, model) -> list:
        return [model.rotary_emb]

    def rotary(self, model, j: int):
        return model.rotary_emb

    def layer_forward(self, layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary,
                      cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return layer.forward_attending(hidden, residual, rotary, cos, sin, attend)

    def final_norm(self, model, hidden: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return model.norm(hidden, residual)[0]

    def logits(self, skeleton, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Gemma3Streaming:
    name = "Gemma 3"

    def embed(self, model, rows: torch.Tensor) -> torch.Tensor:
        return rows * model.embed_scale

    def rotaries(self, model) -> list:
        return [model.rotary_local, model.rotary_global]

    def rotary(self, model, j: int):
        from kvforge.models.gemma3 import SLIDING
        return model.rotary_local if model.layers[j].layer_type == SLIDING else model.rotary_global

    def layer_forward(self, layer, hidden: torch.Tensor, residual: torch.Tensor | None, rotary,
                      cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                      ) -> tuple[torch.Tensor, None]:
        return layer.forward_attending(hidden, rotary, cos, sin, attend), None

    def final_norm(self, model, hidden: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return model.norm(hidden)

    def logits(self, skeleton, logits: torch.Tensor) -> torch.Tensor:
        cap = skeleton.options.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def streamed_family(model_class: type):
    """The family adapter of a model class; ValueError naming the class where the streamed
    forward would run it wrong (GPT-2's learned positions, DeepSeek-V2's latent attention)."""
    from kvforge.models.gemma3 import Gemma3ForCausalLM
    from kvforge.models.llama import LlamaForCausalLM
    if issubclass(model_class, Gemma3ForCausalLM):
        return Gemma3Streaming()
    if issubclass(model_class, LlamaForCausalLM):
        return LlamaStreaming()
    raise ValueError(f"offloading streams Llama-family decoders (Llama, Mistral, Qwen2, "
                     f"Mixtral, Qwen2-MoE) and Gemma 3; {model_class.__name__} is not supported")
