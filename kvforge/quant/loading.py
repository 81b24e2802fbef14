"""Build a model with its quantization: choose the config, swap linear methods, load, calibrate.

    EngineConfig.quantization ("auto" | "none" | int8 | int4 | gguf | ...)  ─┐
    or a saved quantized directory (kvforge_quantization.json) ─────┴─► QuantizationConfig
    model = ModelClass(config)                 float layers (torch.empty: pages never touched)
    apply_quantization(model, qc)              every Linear asks qc.get_linear_method(prefix),
                                               every FusedMoE qc.get_experts_method(prefix)
    model.load_weights(weights)                shards quantize as they arrive
    qc.calibrate(model, batches)               only methods that need activation statistics

The swap happens after construction, so model families need no quantization code of their own.
"""
from __future__ import annotations

import logging

import torch

from kvforge.layers.linear import Linear, UnquantizedLinearMethod
from kvforge.layers.moe import FusedMoE
from kvforge.loader.source import ModelSource
from kvforge.models.registry import get_model_class
from kvforge.quant.base import QuantizationConfig, get_quantization_config, is_moe_router
from kvforge.quant.gguf import gguf_block_buffers
from kvforge.quant.moe_experts import replace_experts_method
from kvforge.quant.serialize import iter_saved_weights, read_saved_quantization

logger = logging.getLogger(__name__)


def apply_quantization(model: torch.nn.Module, quant_config: QuantizationConfig) -> int:
    """Give every Linear of ``model`` the method ``quant_config`` picks for its name (None keeps
    it float; MoE routers always stay float) and every FusedMoE its experts' method; must run
    before weights are loaded. Returns the number of layers swapped."""
    swapped = quant_config.replace_modules(model)
    for prefix, layer in model.named_modules():
        if isinstance(layer, FusedMoE):
            experts = quant_config.get_experts_method(prefix)
            if experts is not None:
                replace_experts_method(layer, experts)
                swapped += 1
            continue
        if not isinstance(layer, Linear) or is_moe_router(prefix):
            continue
        method = quant_config.get_linear_method(prefix)
        if method is None:
            continue
        float_weight = layer._parameters.get("weight", layer._parameters.get("weight_t"))
        dtype = float_weight.dtype if float_weight is not None else torch.float32
        device = float_weight.device if float_weight is not None else torch.device("cpu")
        for name in ("weight", "weight_t", "bias"):
            if name in layer._parameters:
                del layer._parameters[name]
        layer.bias = None
        layer.method = method
        try:
            method.create_weights(layer, dtype, device)
        except ValueError as refusal:       # e.g. a CPU-kernel format on another device
            raise ValueError(f"quantization {quant_config.name!r}, layer {prefix!r}: "
                             f"{refusal}") from None
        swapped += 1
    # a tied float head reads the embedding tensor; a quantized one loads its own copy from it
    if getattr(model, "_head_shares_embedding", False) and \
            not isinstance(model.lm_head.method, UnquantizedLinearMethod):
        model._head_shares_embedding = False
    return swapped


def auto_quantization(source: ModelSource, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> str:
    """What ``--quantization auto`` (the default) runs: a GGUF file in its own blocks ("gguf")
    where the compiled kernels run (fp32 activations on CPU), anything else as stored ("none":
    a GGUF file then dequantized to fp32)."""
    from kvforge.kernels import cpu_kernels
    if (source.format == "gguf" and dtype == torch.float32
            and torch.device(device).type == "cpu" and cpu_kernels() is not None):
        return "gguf"
    return "none"


def resolve_quant_config(name: str, args: dict | None, source: ModelSource,
                         dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                         ) -> tuple[QuantizationConfig | None, bool]:
    """-> (config, whether the source is a saved quantized model)."""
    saved = read_saved_quantization(source.path) if source.format == "hf" else None
    if saved is not None:
        saved_name, saved_args = saved
        if name not in (None, "", "none", "auto", saved_name):
            raise ValueError(f"{source.path!r} is already quantized with {saved_name!r}; "
                             f"cannot apply --quantization {name!r} on top")
        return get_quantization_config(saved_name, **saved_args), True
    if name == "auto":
        name = auto_quantization(source, dtype, device)
        if name == "none" and args:
            raise ValueError(f"quantization options {args} need a --quantization method")
    return get_quantization_config(name, **(args or {})), False


def load_model(source: ModelSource, *, quantization: str = "none",
               quantization_args: dict | None = None, attn_backend: str = "paged",
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
               ) -> torch.nn.Module:
    model_cls = get_model_class(source.config.architecture)
    model = model_cls(source.config, attn_backend=attn_backend, dtype=dtype, device=device)
    quant_config, saved = resolve_quant_config(quantization, quantization_args, source, dtype,
                                               device)
    model.quant_config = quant_config
    if quant_config is None:
        model.load_weights(source.iter_weights())
        return model
    n = apply_quantization(model, quant_config)
    logger.info("quantization %s: %d linear layers", quant_config.name, n)
    model.load_weights(iter_saved_weights(source.path) if saved else quant_config.iter_weights(source))
    if quant_config.needs_calibration and saved:
        # the saved rows carry the calibration; a layer missing from the file is an error,
        # never a silent recalibration
        pending = quant_config.pending_layers()
        if pending:
            raise ValueError(f"{source.path!r} has no saved {quant_config.name} rows for "
                             f"{len(pending)} layers, e.g. {pending[0]!r}")
    elif quant_config.needs_calibration:
        from kvforge.quant.calibration import calibration_token_batches
        quant_config.calibrate(model, calibration_token_batches(source.load_tokenizer().encode))
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter (quantized codes, scales, float norms and embeddings) and of
    the GGUF blocks a natively run file keeps as buffers (views of the mapped file)."""
    blocks = sum(b.numel() * b.element_size() for b in gguf_block_buffers(model, recurse=True))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + blocks


__all__ = ["apply_quantization", "auto_quantization", "resolve_quant_config", "load_model", "weight_bytes"]
