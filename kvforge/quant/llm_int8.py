"""LLM.int8() (Dettmers et al. 2022): int8 x int8 matmul with outlier decomposition.

A few input features of a transformer's hidden state carry values far larger than the rest; one
per-token int8 scale would spend the whole range on them and round everything else to zero. So,
per call, the input features whose magnitude exceeds ``threshold`` in ANY token of the batch are
split off and multiplied in fp32; the rest go through int8 x int8:

    x [T, in]  --features |x| > threshold-->  x[:, O] @ W_deq[:, O]^T     fp32 (exact product)
               --all other features ------->  int8(x[:, ~O]) @ Wq[~O, :]  torch._int_mm, rescaled
    y = sum of both (+ bias)

Storage is int8 only (per-output-channel scales): the outlier path multiplies by the dequantized
int8 weight columns, as bitsandbytes does, since keeping an fp copy of W for the few outlier
columns would cost more memory than the int8 weights save. The outlier product is therefore
exact given the stored weight; its error is the weight rounding alone, never activation rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.linear import UnquantizedLinearMethod
from kvforge.quant.base import is_lm_head, QuantizationConfig, register_quantization
from kvforge.quant.int8 import Int8Rows
from kvforge.quant.w8a8_ops import (int8_matmul, quantize_per_token, quantize_weight_per_channel,
                                    take_float_weight)


class LLMInt8LinearMethod(UnquantizedLinearMethod):
    """Loads like the float method, then quantizes it in
    ``process_weights_after_loading`` to ``qweight_t`` [in, out] int8 + ``weight_scale`` [out].
    ``Int8Rows`` (a saved model's rows) are stored as they are."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def load_weight(self, layer, kind, loaded, output_offset):
        if kind != "weight" or not isinstance(loaded, Int8Rows):
            if kind == "weight" and hasattr(layer, "qweight_t"):
                raise ValueError("llm_int8 layer got a float weight after its saved int8 rows")
            return super().load_weight(layer, kind, loaded, output_offset)
        if loaded.shape[1] != layer.input_size:
            raise ValueError(f"int8 rows of shape {tuple(loaded.shape)} do not fit a linear layer "
                             f"with input_size {layer.input_size}")
        if not hasattr(layer, "qweight_t"):
            placeholder = take_float_weight(layer)
            device = placeholder.device if placeholder is not None else torch.device("cpu")
            n, k = layer.output_size, layer.input_size
            layer.qweight_t = nn.Parameter(torch.zeros(k, n, dtype=torch.int8, device=device),
                                           requires_grad=False)
            layer.weight_scale = nn.Parameter(torch.zeros(n, device=device), requires_grad=False)
        rows = slice(output_offset, output_offset + loaded.shape[0])
        layer.qweight_t[:, rows] = loaded.q.t()
        layer.weight_scale[rows] = loaded.scale.float()

    def export_rows(self, layer) -> Int8Rows:
        return Int8Rows(layer.qweight_t.detach().t(), layer.weight_scale.detach())

    def process_weights_after_loading(self, layer):
        weight = take_float_weight(layer)
        if weight is None:
            return                                   # already quantized (idempotent)
        qweight_t, scale = quantize_weight_per_channel(weight)
        layer.qweight_t = nn.Parameter(qweight_t, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer, x):
        if not hasattr(layer, "qweight_t"):
            raise RuntimeError("llm_int8 layer used before process_weights_after_loading()")
        x2d = x.reshape(-1, layer.input_size).float()
        outlier_cols = (x2d.abs() > self.threshold).any(dim=0).nonzero().flatten()
        if outlier_cols.numel():
            # zero the outlier features in the int8 operand; they are added back in fp32 below
            regular = x2d.index_fill(1, outlier_cols, 0.0)
        else:
            regular = x2d
        xq, x_scale = quantize_per_token(regular)
        y = int8_matmul(xq, x_scale, layer.qweight_t, layer.weight_scale)
        if outlier_cols.numel():
            w_cols = layer.qweight_t.index_select(0, outlier_cols).float() * layer.weight_scale
            y.addmm_(x2d.index_select(1, outlier_cols), w_cols)
        if layer.has_bias:
            y.add_(layer.bias.float())
        return y.to(x.dtype).view(*x.shape[:-1], layer.output_size)


@register_quantization("llm_int8")
class LLMInt8Config(QuantizationConfig):
    """``threshold``: input features with |x| above it in any token of a batch run in fp32
    (6.0 is the paper's value). The LM head stays in float (its logits decide every token)."""

    def __init__(self, threshold: float = 6.0) -> None:
        if not threshold > 0:
            raise ValueError(f"llm_int8 threshold must be > 0, got {threshold!r}")
        self.threshold = float(threshold)

    def get_linear_method(self, prefix: str):
        if is_lm_head(prefix):
            return None
        return LLMInt8LinearMethod(self.threshold)

    def describe(self) -> dict:
        return {"threshold": self.threshold}
