"""Average storage bits per weight of a quantized model's linear layers."""
from __future__ import annotations

import torch

from kvforge.layers.linear import Linear, UnquantizedLinearMethod
from kvforge.quant.base import is_lm_head
from kvforge.quant.gguf import GGUFEmbedding, gguf_block_buffers


def average_bits(model: torch.nn.Module) -> float:
    """Bits of every parameter of the quantized linear layers except biases (codes, scales,
    zeros, second-level statistics, outliers, low-rank factors) per weight they stand for.
    The LM head is left out: methods keep it int8 or float regardless of their format, and at
    49152 x 576 it would dominate a small model's figure. Float layers count 32 bits; a GGUF
    layer counts its blocks (scales and minimums included)."""
    bits = weights = 0
    for prefix, module in model.named_modules():
        # a GGUF file's embedding is a Linear over its blocks, but looks tokens up: left out
        if not isinstance(module, Linear) or is_lm_head(prefix) or isinstance(module,
                                                                            GGUFEmbedding):
            continue
        weights += module.input_size * module.output_size
        if type(module.method) is UnquantizedLinearMethod:
            bits += 32 * module.input_size * module.output_size
            continue
        # parameters, and a GGUF layer's blocks (buffers: views of the mapped file)
        stored = [p for name, p in module.named_parameters(recurse=False) if name != "bias"]
        stored += gguf_block_buffers(module)
        bits += sum(8 * p.numel() * p.element_size() for p in stored)
    if weights == 0:
        raise ValueError("the model has no linear layers")
    return bits / weights
