"""Quantization methods: a registry of configs that hand out a LinearMethod per layer.

Contract: a ``QuantizationConfig`` subclass is registered under its CLI name
(``--quantization NAME``). The model asks ``get_linear_method(prefix)`` for every linear layer
it builds (``prefix`` is the HF module name, e.g. ``model.layers.3.mlp.down_proj`` or
``lm_head``); returning ``None`` keeps that layer unquantized (MoE routers are never asked).
``get_experts_method(prefix)`` does the same for the stacked experts of a ``FusedMoE``. The
returned method (kvforge.layers.linear.LinearMethod) owns the layer's storage and kernel;
quantization happens in ``process_weights_after_loading`` (or at load for pre-quantized sources
such as GGUF blocks).
Methods that need calibration (AWQ, SmoothQuant) implement ``calibrate(model, batches)``, called
by the engine before weights are finalised; their results are saved with the model so that a
reload does not recalibrate.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

from kvforge.layers.linear import LinearMethod

_QUANT_CONFIGS: dict[str, type["QuantizationConfig"]] = {}


def register_quantization(name: str):
    def deco(cls):
        _QUANT_CONFIGS[name] = cls
        cls.name = name
        return cls
    return deco


def available_quantizations() -> list[str]:
    _import_builtin()
    return sorted(_QUANT_CONFIGS)


def get_quantization_config(name: str, **kwargs: Any) -> "QuantizationConfig | None":
    """``none`` (or None) -> None; unknown names raise ValueError listing the known ones."""
    if name in (None, "", "none"):
        return None
    _import_builtin()
    if name not in _QUANT_CONFIGS:
        raise ValueError(f"unknown quantization {name!r}; known: {['none'] + sorted(_QUANT_CONFIGS)}")
    cls = _QUANT_CONFIGS[name]
    params = inspect.signature(cls.__init__).parameters
    accepted = [p for p in params if p != "self"]
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [] if open_ended else sorted(set(kwargs) - set(accepted))
    if unknown:   # a TypeError from the constructor would not say which options exist
        raise ValueError(f"quantization {name!r} has no option {unknown[0]!r}; its options: "
                         f"{accepted}")
    return cls(**kwargs)


def _import_builtin() -> None:
    import importlib
    import pkgutil

    import kvforge.quant as pkg
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name not in ("base",):
            importlib.import_module(f"kvforge.quant.{mod.name}")


def is_moe_router(prefix: str) -> bool:
    """Whether a linear layer is an MoE router (Mixtral / Qwen2-MoE ``mlp.gate``, Qwen2-MoE's
    ``shared_expert_gate``): every config keeps these float, since a rounding error there
    changes which experts run, and they are tiny ([E, H])."""
    return prefix.endswith(".mlp.gate") or prefix.endswith(".shared_expert_gate")


def is_lm_head(prefix: str) -> bool:
    """Whether a linear layer's HF module name is the output projection (configs treat it apart:
    it feeds the logits directly and is the largest single matrix of small models)."""
    return prefix == "lm_head" or prefix.endswith(".lm_head")


class QuantizationConfig(ABC):
    name: str = "base"
    needs_calibration: bool = False

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod | None: ...

    def get_experts_method(self, prefix: str):
        """The ``ExpertsMethod`` (layers/moe.py) for the ``FusedMoE`` named ``prefix``; None keeps
        the experts float (the default: only weight-only int8/int4 quantize experts)."""
        return None

    def replace_modules(self, model) -> int:
        """Swap modules other than Linear / FusedMoE before weights load (e.g. GGUF keeps the
        token embedding in its blocks); returns how many. Default: none."""
        return 0

    def calibrate(self, model, batches) -> None:  # pragma: no cover - only calibrating methods
        raise NotImplementedError(f"{self.name} needs no calibration")

    def iter_weights(self, source):
        """(HF name, weight) pairs to load; a method that reads a file's own quantized blocks
        (GGUF) overrides this to yield ready-quantized objects instead of float tensors."""
        return source.iter_weights()

    def describe(self) -> dict[str, Any]:
        """Constructor arguments that rebuild this config (saved with a quantized model)."""
        return {}


def weight_shard_rows(layer, kind: str, loaded, output_offset: int) -> slice | None:
    """Shared head of the quantized ``load_weight``s: the output rows a weight shard fills, or
    None when it was a bias shard (copied here). Raises on a weight whose shape cannot fit."""
    rows = slice(output_offset, output_offset + loaded.shape[0])
    if load_bias_shard(layer, kind, loaded, rows):
        return None
    if len(loaded.shape) != 2 or loaded.shape[1] != layer.input_size:
        raise ValueError(f"weight of shape {tuple(loaded.shape)} does not fit a linear layer "
                         f"with input_size {layer.input_size}")
    return rows


def load_bias_shard(layer, kind: str, loaded, rows: slice) -> bool:
    """Shared head of the quantized ``load_weight``s: copies a bias shard into ``rows`` and
    returns True; returns False for a weight shard; raises on an unknown kind or a stray bias."""
    if kind == "bias":
        if not layer.has_bias:
            raise ValueError("got a bias for a linear layer created without bias")
        layer.bias[rows].copy_(loaded)
        return True
    if kind != "weight":
        raise ValueError(f"unknown linear parameter kind {kind!r}; expected 'weight' or 'bias'")
    return False
