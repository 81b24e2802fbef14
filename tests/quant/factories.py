"""Factories for quantization tests: synthetic linears with outlier input channels, and a
quantized Llama built from a tiny random HF checkpoint."""
from __future__ import annotations

import torch

from kvforge.layers.linear import Linear


def make_linear(weight: torch.Tensor, method, bias: torch.Tensor | None = None) -> Linear:
    """A Linear with ``method``, loaded with W [out, in] (+ bias) and processed."""
    out_features, in_features = weight.shape
    layer = Linear(in_features, out_features, bias=bias is not None, method=method)
    layer.load_weight("weight", weight)
    if bias is not None:
        layer.load_weight("bias", bias)
    layer.process_weights_after_loading()
    return layer


def outlier_activations(num_tokens: int, in_features: int, outlier_channels: list[int],
                        outlier_scale: float = 40.0, seed: int = 0) -> torch.Tensor:
    """x ~ N(0, 1) with a few channels scaled up (the LLM activation pattern SmoothQuant,
    LLM.int8() and AWQ target)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=g)
    x[:, outlier_channels] *= outlier_scale
    return x


def random_weight(out_features: int, in_features: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.05


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def build_quantized_llama(hf_dir: str, quant_config, attn_backend: str = "paged"):
    """Our Llama from a tiny HF dir with every linear's method from ``quant_config`` (None keeps
    float), weights loaded and processed. Mirrors what the engine's loader does."""
    from kvforge.loader.source import load_model_source
    from kvforge.models.llama import LlamaForCausalLM
    source = load_model_source(hf_dir)
    model = LlamaForCausalLM(source.config, attn_backend=attn_backend)
    if quant_config is not None:
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                method = quant_config.get_linear_method(name)
                if method is not None:
                    module.method = method
                    method.create_weights(module, torch.float32, "cpu")
    model.load_weights(source.iter_weights())
    return model.eval(), source
