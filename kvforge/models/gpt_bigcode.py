"""GPTBigCode (SantaCoder / StarCoder): the GPT-2 network with multi-query attention.

With ``multi_query`` (the default) all query heads share ONE K/V head, so the cache holds
``2 * head_dim`` values per token per layer instead of GPT-2's ``2 * hidden`` — ``num_heads``
times less. Differences from GPT-2, all through gpt2.py's family hooks:

  - projections are ``nn.Linear`` ([out, in]), not Conv1D: no transpose on load;
  - ``c_attn`` rows with multi_query:   [ q (H) | k (head_dim) | v (head_dim) ]  (GPT-2's order);
    without multi_query they are interleaved per head and reordered on load:
        [h0: q k v | h1: q k v | ...]   view [heads, 3, head_dim] -> [3, heads, head_dim]
"""
from __future__ import annotations

import torch

from kvforge.models.config import ModelConfig
from kvforge.models.gpt2 import GPT2LMHeadModel


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    conv1d_weights = False

    @staticmethod
    def num_kv_heads(config: ModelConfig) -> int:
        return 1 if config.hf_config.get("multi_query", True) else config.num_attention_heads

    def c_attn_rows(self, weight_or_bias: torch.Tensor) -> torch.Tensor:
        if self.num_kv_heads(self.config) == 1:
            return weight_or_bias
        heads = self.config.num_attention_heads
        rest = weight_or_bias.shape[1:]
        return (weight_or_bias.reshape(heads, 3, -1, *rest).transpose(0, 1)
                .reshape(weight_or_bias.shape))
