"""Analytic work per token of a Llama-family decoder: matmul FLOPs and weight bytes.

Counted from the config, not from an nn.Module, so a fused qkv projection or a tied LM head
does not change the numbers. Shapes (H hidden, I intermediate, V vocab, L layers,
nh / nkv query / KV heads of size hd):

    per layer   q: H x nh*hd    k, v: H x nkv*hd    o: nh*hd x H    gate, up: H x I    down: I x H
    LM head     H x V           (applied even when tied to the embedding)

FLOPs of one request with P prompt tokens and O output tokens (the last sampled token is
never fed back, so n = P + O - 1 positions go through the layers, and O rows of logits are
computed):

    2 * W_layers * n  +  2 * W_head * O  +  4 * L * nh * hd * n(n+1)/2

The last term is attention: at position p a query head does a q.k dot and a p.v axpy over
p + 1 keys, 2 FLOPs per multiply-add, so 4 * hd * (p + 1) per head per layer; summed over
p = 0 .. n-1 that is n(n+1)/2 key positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a kvforge ModelConfig or a Hugging Face config (same attribute names)."""
        heads = cfg.num_attention_heads
        return cls(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                   num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)

    @property
    def layer_matmul_params(self) -> int:
        """Matmul weights of all decoder layers (attention projections + gated MLP)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def matmul_params(self) -> int:
        return self.layer_matmul_params + self.head_params

    @property
    def norm_params(self) -> int:
        """Two RMSNorm weights per layer plus the final norm."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def kv_bytes_per_cached_token(self) -> int:
        """fp32 K and V of one token in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        """Useful FLOPs of one request (formula in the module docstring)."""
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
        n = prompt_len + output_len - 1
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * n * (n + 1) / 2
        return 2.0 * self.layer_matmul_params * n + 2.0 * self.head_params * output_len + attn

    def decode_flops(self, prompt_len: int, output_len: int) -> float:
        """FLOPs after the first token: a request's work minus its prefill (+ first sample)."""
        return self.request_flops(prompt_len, output_len) - self.request_flops(prompt_len, 1)

    def decode_bytes_per_token(self, context_len: int, dtype_bytes: int = 4) -> float:
        """Bytes one batch-1 decode step must read: every matmul weight, the norms, one
        embedding row, and the K/V of ``context_len`` cached tokens."""
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        weights = (self.matmul_params + self.norm_params + self.hidden_size) * dtype_bytes
        return float(weights + self.kv_bytes_per_cached_token * context_len)
