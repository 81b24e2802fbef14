"""Weight-only INT4, group-wise asymmetric, round-to-nearest (``--quantization int4``).

Storage per layer (see packing.py for the number format):
    qweight        kernel-packed codes [N, Kp/2] uint8   (4 bits per weight)
    scales_zeros   [Kp/G, N, 2] bf16: (step, value of code 8) per row per group
Forward: ``torch._weight_int4pack_mm_for_cpu`` on bf16 activations; the matrix is never
dequantized. Shards (q|k|v, gate|up) are quantized as they arrive -- groups run along the input
dimension, so a row's codes do not depend on the other rows -- and the layer is packed for the
kernel as soon as its last row is loaded, so loading never holds a float copy of the model.
Besides float tensors, ``load_weight`` accepts ``Int4Blocks`` (codes already chosen: a reload of
a saved model, or GGUF Q4_0/Q4_1 blocks), which are stored as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.linear import LinearMethod
from kvforge.quant import packing
from kvforge.quant.base import (QuantizationConfig, is_lm_head, load_bias_shard,
                                register_quantization)
from kvforge.quant.int8 import Int8LinearMethod, lm_head_method
from kvforge.quant.lowrank import LoRCConfigMixin
from kvforge.quant.row_formats import GroupedCodeRows


@dataclass
class Int4Blocks(GroupedCodeRows):
    """Rows of an INT4 weight whose codes are already chosen (portable form, see packing.py).

    codes [n, Kp] uint8 0..15, scale / zero [n, Kp/G]; ``shape`` is the logical (n, K), so the
    model's loader can check it like a tensor's."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    in_features: int


class Int4LinearMethod(LinearMethod):
    def __init__(self, group_size: int = 64) -> None:
        self.group_size = packing.check_int4_group_size(group_size)

    # ------------------------------------------------------------------ loading
    def create_weights(self, layer, dtype, device):
        if torch.device(device).type not in ("cpu", "meta"):
            raise ValueError(f"int4 weights run on PyTorch's CPU kernel; device {device!r} "
                             f"is not supported")
        k, n = layer.input_size, layer.output_size
        layer.padded_input_size = packing.padded_in_features(k, self.group_size)
        groups = layer.padded_input_size // self.group_size
        # staging for codes until every row is loaded, then replaced by the packed form
        layer._int4_codes = torch.zeros(n, layer.padded_input_size, dtype=torch.uint8, device=device)
        layer._int4_scale = torch.zeros(n, groups, dtype=packing.SCALE_DTYPE, device=device)
        layer._int4_zero = torch.zeros(n, groups, dtype=packing.SCALE_DTYPE, device=device)
        layer._int4_rows_loaded = 0
        layer.out_dtype = dtype
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device), requires_grad=False)

    def load_weight(self, layer, kind, loaded, output_offset):
        n = loaded.shape[0]
        rows = slice(output_offset, output_offset + n)
        if load_bias_shard(layer, kind, loaded, rows):
            return
        if not hasattr(layer, "_int4_codes"):
            raise ValueError("int4 layer already finalized; its weights were loaded twice")
        if loaded.shape[1] != layer.input_size:
            raise ValueError(f"weight of shape {tuple(loaded.shape)} does not fit a linear layer "
                             f"with input_size {layer.input_size}")
        blocks = self.to_blocks(loaded)
        if blocks.group_size != self.group_size or blocks.codes.shape[1] != layer.padded_input_size:
            raise ValueError(f"int4 blocks with group {blocks.group_size} do not fit a layer "
                             f"quantized with group {self.group_size}")
        layer._int4_codes[rows] = blocks.codes
        layer._int4_scale[rows] = blocks.scale.to(packing.SCALE_DTYPE)
        layer._int4_zero[rows] = blocks.zero.to(packing.SCALE_DTYPE)
        layer._int4_rows_loaded += n
        if layer._int4_rows_loaded == layer.output_size:
            self._finalize(layer)

    def to_blocks(self, loaded) -> Int4Blocks:
        """A float weight slice or ready blocks -> ``Int4Blocks`` (subclasses add formats)."""
        if isinstance(loaded, Int4Blocks):
            return loaded
        codes, scale, zero = packing.quantize_int4_groupwise(loaded, self.group_size)
        return Int4Blocks(codes, scale, zero, loaded.shape[1])

    def _finalize(self, layer) -> None:
        layer.qweight = nn.Parameter(packing.pack_int4_kernel(layer._int4_codes), requires_grad=False)
        # kernel wants [groups, Np, 2]: (scale, zero) for group g of output row n; the rows
        # padded up to the kernel's multiple of 16 get scale 0, zero 0 (outputs sliced off)
        pad = layer.qweight.shape[0] - layer.output_size
        layer.scales_zeros = nn.Parameter(F.pad(
            torch.stack([layer._int4_scale.t(), layer._int4_zero.t()], dim=-1),
            (0, 0, 0, pad)).contiguous(), requires_grad=False)
        del layer._int4_codes, layer._int4_scale, layer._int4_zero
        # batch-1 decode runs ~120 of these per token and each costs ~20 us at 1 thread; reading
        # the parameters through nn.Module.__getattr__ and shape checks added ~7 us more
        # (benchmarks/quant_kernels.py), so apply reads plain references to the same tensors
        self._kernel_weights = (layer.qweight, layer.scales_zeros)
        self._pad_in = layer.padded_input_size - layer.input_size
        self._sliced_out = pad != 0

    def process_weights_after_loading(self, layer):
        if hasattr(layer, "_int4_codes"):
            raise ValueError(f"int4 layer got {layer._int4_rows_loaded} of {layer.output_size} "
                             f"weight rows")

    # ------------------------------------------------------------------ forward
    def apply(self, layer, x):
        qweight, scales_zeros = self._kernel_weights
        x2d = x.reshape(-1, layer.input_size).to(torch.bfloat16)
        if self._pad_in:
            x2d = F.pad(x2d, (0, self._pad_in))
        y = torch._weight_int4pack_mm_for_cpu(x2d, qweight, self.group_size, scales_zeros)
        if self._sliced_out:
            y = y[:, :layer.output_size]
        y = y.to(x.dtype)
        if layer.has_bias:
            y += layer.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], layer.output_size)

    # ------------------------------------------------------------------ export
    def export_blocks(self, layer) -> Int4Blocks:
        """The layer's codes in portable form (for saving and for reference checks)."""
        codes = packing.unpack_int4_kernel(layer.qweight, layer.output_size, layer.padded_input_size)
        sz = layer.scales_zeros[:, :layer.output_size]
        return Int4Blocks(codes, sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous(),
                          layer.input_size)

    def export_rows(self, layer) -> Int4Blocks:
        """What a save writes (serialize.py): the portable blocks."""
        return self.export_blocks(layer)

    def dequantize(self, layer) -> torch.Tensor:
        b = self.export_blocks(layer)
        return packing.dequantize_int4(b.codes, b.scale, b.zero, layer.input_size)


@register_quantization("int4")
class Int4Config(LoRCConfigMixin, QuantizationConfig):
    """``group_size`` in 32/64/128; ``lm_head``: "int8" (default), "int4" (group 32: faster at
    batch 1, a little perplexity) or "none" (keep it float); ``lorc_rank``: LoRC low-rank
    compensation of every quantized layer (lowrank.py; 0 = off), ``lorc_act``: 1 weighs its
    factors by calibration activations."""

    def __init__(self, group_size: int = 64, lm_head: str = "int8", lorc_rank: int = 0,
                 lorc_act: int = 0) -> None:
        self.group_size = packing.check_int4_group_size(group_size)
        self.lm_head = lm_head
        lm_head_method(lm_head, "lm_head")   # validates the choice
        self.init_lorc(lorc_rank, lorc_act)

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return self.lorc(lm_head_method(self.lm_head, prefix), prefix)
        return self.lorc(Int4LinearMethod(self.group_size), prefix)

    def get_experts_method(self, prefix: str):
        from kvforge.quant.moe_experts import Int4ExpertsMethod
        return Int4ExpertsMethod(self.group_size)

    def describe(self) -> dict:
        out = {"group_size": self.group_size, "lm_head": self.lm_head}
        return {**out, **self.lorc_args()}


__all__ = ["Int4Blocks", "Int4LinearMethod", "Int4Config", "Int8LinearMethod"]
