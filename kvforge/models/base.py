"""What every causal LM family shares: the paged-KV facts and checkpoint-loading helpers.

A family file (llama.py, gpt2.py, deepseek_v2.py, ...) defines its layers and routes checkpoint
names; sizes of the KV cache and the bookkeeping of which tensors were loaded live here once.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvforge.layers.linear import Linear, MergedLinear
from kvforge.layers.moe import FusedMoE


class PagedKVModelMixin:
    """KV-cache facts derived from the first layer's attention backend (every layer has the same
    shape). Subclasses implement ``first_attention_backend()``."""

    dtype: torch.dtype
    num_layers: int

    def first_attention_backend(self):
        raise NotImplementedError

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.first_attention_backend().kv_cache_shape(num_blocks, block_size))

    def kv_cache_dtype(self) -> torch.dtype:
        backend = self.first_attention_backend()
        return backend.cache_dtype(self.dtype)

    def kv_cache_bytes_per_token(self) -> int:
        return self.kv_cache_bytes_per_block(1)          # one block of one token, all planes

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens in every layer, with whatever the backend
        keeps per block besides K/V (QUEST's key bounds rows)."""
        per_layer = math.prod(self.kv_cache_shape(1, block_size))
        return per_layer * torch.empty((), dtype=self.kv_cache_dtype()).element_size() * self.num_layers


class RotaryDecoderLMMixin(PagedKVModelMixin):
    """The forward of families laid out as ``self.model.{embed_tokens, rotary_emb, layers, norm}``
    + ``self.lm_head`` (Llama and its relatives, DeepSeek-V2): each layer takes
    ``(hidden, residual, rotary, cos, sin, kv_cache, meta)`` and returns ``(hidden, residual)``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] final-normed hidden states."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {self.num_layers} layers")
        model = self.model
        hidden = model.embed_tokens(input_ids)
        rotary = model.rotary_emb
        cos, sin = rotary.cos_sin(positions)       # gathered once, shared by every layer
        residual = None
        for layer, kv_cache in zip(model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rotary, cos, sin, kv_cache, meta)
        hidden, _ = model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def first_attention_backend(self):
        return self.model.layers[0].self_attn.attn


def expected_weight_keys(model: nn.Module, extra=None) -> set[str]:
    """Keys a complete checkpoint fills: ``name.weight`` / ``name.bias`` of each Linear,
    ``name.kind#shard`` per shard of a MergedLinear, plain parameters of other modules.
    ``extra(name, module)`` may claim a module by returning its keys (or None to fall through)."""
    expected: set[str] = set()
    for name, module in model.named_modules():
        claimed = extra(name, module) if extra is not None else None
        if claimed is not None:
            expected |= claimed
        elif isinstance(module, MergedLinear):
            kinds = ("weight", "bias") if module.has_bias else ("weight",)
            expected |= {f"{name}.{k}#{i}" for k in kinds for i in range(len(module.output_sizes))}
        elif isinstance(module, Linear):
            expected |= {f"{name}.weight"} | ({f"{name}.bias"} if module.has_bias else set())
        elif isinstance(module, FusedMoE):
            # whatever its method stores (float w13/w2, int8 codes + scales, ...); per-expert
            # completeness is FusedMoE.check_loaded's job
            expected |= {f"{name}.w13", f"{name}.w2"}
        else:
            expected |= {f"{name}.{p}" for p in module._parameters}
    return expected


def copy_plain_parameter(module: nn.Module | None, kind: str, name: str, tensor: torch.Tensor,
                         architecture: str) -> None:
    """Copy a checkpoint tensor into a plain (non-Linear) parameter, checking name and shape."""
    param = None if module is None else module._parameters.get(kind)
    if param is None:
        raise ValueError(f"unexpected weight {name!r} for {architecture}")
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                         f"{tuple(param.shape)}")
    param.copy_(tensor)


def finish_loading(model: nn.Module, expected: set[str], loaded: set[str]) -> None:
    """Refuse a partial checkpoint, then let each linear layer finalise (e.g. quantize)."""
    missing = expected - loaded
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:10]}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()
