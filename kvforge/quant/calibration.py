"""Calibration for activation-aware methods (SmoothQuant, AWQ): a shipped corpus, a forward pass
that needs no engine, and the base class of methods that quantize from activation statistics.

Flow (the engine, or a test, drives it):

    model built with the method, weights loaded        layers hold the float weight, "pending"
    config.calibrate(model, batches)                   forward passes; each pending layer's apply
                                                       records stats of its input x, then
                                                       ``finish`` turns stats into per-input-
                                                       channel scales and quantizes
    (or) config.load_calibration_state(saved)          before process_weights_after_loading: the
                                                       saved scales quantize without recalibrating

A pending layer refuses to run outside calibration (RuntimeError), so a model whose calibration
was forgotten can never silently serve float weights.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.layers.linear import Linear, UnquantizedLinearMethod
from kvforge.quant.base import QuantizationConfig

CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"


def calibration_token_batches(encode, num_batches: int = 8, seq_len: int = 128,
                              path: str | Path = CALIBRATION_TEXT) -> list[list[int]]:
    """Cut the shipped corpus (written for this project) into up to ``num_batches`` windows of
    ``seq_len`` token ids; ``encode``: str -> list[int] (e.g. ``Tokenizer.encode``)."""
    if num_batches <= 0 or seq_len <= 1:
        raise ValueError(f"need num_batches > 0 and seq_len > 1, got {num_batches}, {seq_len}")
    ids = list(encode(Path(path).read_text(encoding="utf-8")))
    windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not windows:
        windows = [ids]
    return windows[:num_batches]


@torch.inference_mode()
def run_calibration_forward(model, batches: Iterable[Sequence[int]], block_size: int = 16) -> int:
    """Prefill each batch (one sequence of token ids) through ``model`` with a throw-away paged
    KV cache; returns the number of tokens run. Only the side effects (recorded stats) matter."""
    device = next(model.parameters()).device
    num_tokens = 0
    for ids in batches:
        ids = [int(t) for t in ids]
        if not ids:
            continue
        num_blocks = -(-len(ids) // block_size)
        meta = AttentionMetadata.build([len(ids)], [0], [list(range(num_blocks))], block_size,
                                       device)
        cache_dtype = model.kv_cache_dtype() if hasattr(model, "kv_cache_dtype") else model.dtype
        shape = model.kv_cache_shape(num_blocks, block_size)
        caches = [torch.zeros(shape, dtype=cache_dtype, device=device)
                  for _ in range(model.num_layers)]
        model(torch.tensor(ids, device=device), meta.positions(), caches, meta)
        num_tokens += len(ids)
    if num_tokens == 0:
        raise ValueError("calibration got no tokens")
    return num_tokens


class CalibratedLinearMethod(UnquantizedLinearMethod):
    """Float storage until ``finish(layer, scales)`` quantizes; records input statistics while
    its config is calibrating. Subclasses implement ``compute_scales`` and ``quantize``."""

    def __init__(self, config: "CalibratedQuantConfig", prefix: str, max_samples: int = 0) -> None:
        self.config = config
        self.prefix = prefix
        self.max_samples = max_samples          # input rows kept for a search (AWQ); 0 = none
        self.abs_max: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None
        self.num_rows = 0
        self.samples: list[torch.Tensor] = []
        self.scales: torch.Tensor | None = None  # per input channel, set by finish

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def process_weights_after_loading(self, layer):
        saved = self.config.saved_scales.get(self.prefix)
        if saved is not None and not self.quantized:
            self.finish(layer, saved)

    def record(self, x2d: torch.Tensor) -> None:
        a = x2d.detach().float().abs()
        amax, asum = a.amax(dim=0), a.sum(dim=0)
        self.abs_max = amax if self.abs_max is None else torch.maximum(self.abs_max, amax)
        self.abs_sum = asum if self.abs_sum is None else self.abs_sum + asum
        self.num_rows += a.shape[0]
        kept = sum(s.shape[0] for s in self.samples)
        if kept < self.max_samples:
            self.samples.append(x2d.detach().float()[: self.max_samples - kept].clone())

    def apply(self, layer, x):
        if self.quantized:
            return self.apply_quantized(layer, x)
        if not self.config.calibrating:
            raise RuntimeError(f"{self.config.name} layer {self.prefix!r} used before calibration "
                               f"(call config.calibrate(model, batches) or "
                               f"load_calibration_state)")
        self.record(x.reshape(-1, layer.input_size))
        return super().apply(layer, x)

    def finish(self, layer: Linear, scales: torch.Tensor | None = None) -> None:
        if scales is None:
            if self.abs_max is None:
                raise RuntimeError(f"layer {self.prefix!r} saw no calibration input")
            scales = self.compute_scales(layer)
        if scales.shape != (layer.input_size,):
            raise ValueError(f"scales of shape {tuple(scales.shape)} for {self.prefix!r}, "
                             f"expected ({layer.input_size},)")
        self.scales = scales.float().clone()
        self.quantize(layer, self.scales)
        self.abs_max = self.abs_sum = None
        self.samples = []

    @abstractmethod
    def compute_scales(self, layer: Linear) -> torch.Tensor:
        """Per-input-channel scale s: the layer will compute (x / s) @ (W * s)^T."""

    @abstractmethod
    def quantize(self, layer: Linear, scales: torch.Tensor) -> None:
        """Replace the float weight by the quantized storage of W * s."""

    @abstractmethod
    def apply_quantized(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class CalibratedQuantConfig(QuantizationConfig):
    needs_calibration = True

    def __init__(self) -> None:
        self.calibrating = False
        self.methods: dict[str, CalibratedLinearMethod] = {}
        self.saved_scales: dict[str, torch.Tensor] = {}

    def register_method(self, method: CalibratedLinearMethod) -> CalibratedLinearMethod:
        self.methods[method.prefix] = method
        return method

    def calibrate(self, model, batches: Iterable[Sequence[int]]) -> None:
        """Run ``batches`` (token-id sequences) through ``model`` recording every pending layer's
        inputs, then quantize those layers. Layers already quantized are left alone."""
        layers = [(m, m.method) for m in model.modules()
                  if isinstance(m, Linear) and isinstance(m.method, CalibratedLinearMethod)
                  and m.method.config is self and not m.method.quantized]
        if not layers:
            return
        self.calibrating = True
        try:
            run_calibration_forward(model, batches)
        finally:
            self.calibrating = False
        for layer, method in layers:
            method.finish(layer)

    def calibrate_layer(self, layer: Linear, inputs: Iterable[torch.Tensor]) -> None:
        """Calibrate one pending layer on given activations (unit tests, layers outside a model)."""
        if not isinstance(layer.method, CalibratedLinearMethod) or layer.method.config is not self:
            raise ValueError("layer does not use a method of this config")
        self.calibrating = True
        try:
            with torch.inference_mode():
                for x in inputs:
                    layer(x)
        finally:
            self.calibrating = False
        layer.method.finish(layer)

    def calibration_state(self) -> dict[str, torch.Tensor]:
        """{layer prefix: per-input-channel scales}: what a save needs to skip recalibration."""
        return {p: m.scales.clone() for p, m in self.methods.items() if m.scales is not None}

    def load_calibration_state(self, state: dict[str, torch.Tensor]) -> None:
        """Install saved scales; call before the model's weights are loaded/processed."""
        self.saved_scales = {p: torch.as_tensor(s).float() for p, s in state.items()}
