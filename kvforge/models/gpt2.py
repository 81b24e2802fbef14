"""GPT-2: learned absolute positions, pre-LayerNorm blocks, multi-head attention (every query
head has its own K/V head), GELU (tanh approximation) MLP, LM head tied to the token embedding.

    hidden = wte[ids] + wpe[positions]
    per block:  hidden += c_proj(attn(c_attn(ln_1(hidden))))
                hidden += mlp.c_proj(gelu(mlp.c_fc(ln_2(hidden))))
    logits = ln_f(hidden) @ wte^T

Checkpoint quirks handled in ``load_weights``:
  - GPT-2 stores its projections as ``Conv1D``: weight [in, out], the transpose of a Linear's
    [out, in]; they are transposed on load. ``c_attn`` is q|k|v fused along ``out``:
        c_attn.weight^T rows  [0, H) q   [H, 2H) k   [2H, 3H) v      -> MergedLinear shards 0, 1, 2
  - the original OpenAI checkpoints have no ``transformer.`` prefix and carry ``attn.bias`` /
    ``attn.masked_bias`` causal-mask buffers, which are skipped.
GPTBigCode (gpt_bigcode.py) is the same network with nn.Linear weights and multi-query attention;
it subclasses this and overrides the hooks marked "family hook".
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvforge.attention.base import get_backend_cls
from kvforge.attention.metadata import AttentionMetadata
from kvforge.layers.embedding import uninitialized_embedding
from kvforge.layers.activation import get_act_fn
from kvforge.layers.linear import Linear, MergedLinear
from kvforge.models.base import (PagedKVModelMixin, copy_plain_parameter, expected_weight_keys,
                                 finish_loading)
from kvforge.models.config import ModelConfig


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, num_kv_heads: int, scale: float, attn_backend: str,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden // self.num_heads
        self.kv_size = num_kv_heads * self.head_dim
        self.c_attn = MergedLinear(hidden, [hidden, self.kv_size, self.kv_size], bias=True,
                                   dtype=dtype, device=device)
        self.c_proj = Linear(hidden, hidden, bias=True, dtype=dtype, device=device)
        self.attn = get_backend_cls(attn_backend)(self.num_heads, num_kv_heads, self.head_dim,
                                                  scale=scale)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens, width = hidden.shape
        q, k, v = self.c_attn(hidden).split([width, self.kv_size, self.kv_size], dim=-1)
        out = self.attn.forward(q.view(num_tokens, self.num_heads, self.head_dim),
                                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                                v.view(num_tokens, self.num_kv_heads, self.head_dim),
                                kv_cache, meta)
        return self.c_proj(out.reshape(num_tokens, width))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.c_fc = Linear(hidden, inner, bias=True, dtype=dtype, device=device)
        self.c_proj = Linear(inner, hidden, bias=True, dtype=dtype, device=device)
        self.act_fn = get_act_fn(act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act_fn(self.c_fc(hidden)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, num_kv_heads: int, attn_backend: str,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        eps = hf.get("layer_norm_epsilon", 1e-5)
        head_dim = hidden // config.num_attention_heads
        scale = head_dim ** -0.5 if hf.get("scale_attn_weights", True) else 1.0
        if hf.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.ln_1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.attn = GPT2Attention(config, num_kv_heads, scale, attn_backend, dtype, device)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.mlp = GPT2MLP(hidden, hf.get("n_inner") or 4 * hidden,
                           hf.get("activation_function", "gelu_new"), dtype, device)

    def forward(self, hidden, kv_cache, meta):
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, num_kv_heads: int, attn_backend: str,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.wte = uninitialized_embedding(config.vocab_size, hidden, dtype, device)
        self.wpe = uninitialized_embedding(config.max_position_embeddings, hidden, dtype, device)
        self.h = nn.ModuleList(GPT2Block(config, i, num_kv_heads, attn_backend, dtype, device)
                               for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(hidden, eps=config.hf_config.get("layer_norm_epsilon", 1e-5),
                                 dtype=dtype, device=device)


class GPT2LMHeadModel(PagedKVModelMixin, nn.Module):
    conv1d_weights = True       # family hook: projections stored [in, out]

    def __init__(self, config: ModelConfig, attn_backend: str = "paged",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden size {config.hidden_size} is not a multiple of "
                             f"{config.num_attention_heads} heads")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.dtype = dtype
        # GPT-2 checkpoints always tie; their config.json often does not say so
        self.tied = config.hf_config.get("tie_word_embeddings", True)
        self.transformer = GPT2Model(config, self.num_kv_heads(config), attn_backend, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                              device=device)
        self.requires_grad_(False)

    @staticmethod
    def num_kv_heads(config: ModelConfig) -> int:
        """Family hook: MHA, one K/V head per query head."""
        return config.num_attention_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] after the final LayerNorm."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {self.num_layers} layers")
        t = self.transformer
        hidden = t.wte(input_ids) + t.wpe(positions)
        for block, kv_cache in zip(t.h, kv_caches):
            hidden = block(hidden, kv_cache, meta)
        return t.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def first_attention_backend(self):
        return self.transformer.h[0].attn.attn

    # ------------------------------------------------------------------ weights
    def c_attn_rows(self, weight_or_bias: torch.Tensor) -> torch.Tensor:
        """Family hook: c_attn output rows (in [out, ...] layout) ordered as [q | k | v]."""
        return weight_or_bias

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; ValueError on an unknown name, bad shape or missing tensor."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"          # original OpenAI checkpoints: no prefix
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue                              # causal-mask buffers, not parameters
            if name == "lm_head.weight" and self.tied:
                continue                              # the embedding is the head
            if name == "transformer.wte.weight" and self.tied:
                self.lm_head.load_weight("weight", tensor)
                loaded.add("lm_head.weight")
            loaded |= self._load_one(name, tensor)
        finish_loading(self, expected_weight_keys(self), loaded)

    def _load_one(self, name: str, tensor: torch.Tensor) -> set[str]:
        module_path, _, kind = name.rpartition(".")
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            module = None
        if isinstance(module, Linear) and kind in ("weight", "bias"):
            if kind == "weight" and self.conv1d_weights and module is not self.lm_head:
                tensor = tensor.t()                   # Conv1D [in, out] -> [out, in]
            if not isinstance(module, MergedLinear):
                module.load_weight(kind, tensor)
                return {name}
            if tensor.shape[0] != module.output_size:
                raise ValueError(f"weight {name!r} has {tensor.shape[0]} output rows, expected "
                                 f"{module.output_size}")
            for shard, rows in enumerate(self.c_attn_rows(tensor).split(module.output_sizes)):
                module.load_shard(shard, kind, rows)
            return {f"{module_path}.{kind}#{i}" for i in range(len(module.output_sizes))}
        copy_plain_parameter(module, kind, name, tensor, self.config.architecture)
        return {name}
