"""Calibration for activation-aware methods (SmoothQuant, AWQ): a shipped corpus, a forward pass
that needs no engine, and the base class of methods that quantize from activation statistics.

Flow (the engine, or a test, drives it):

    model built with the method, weights loaded        layers hold the float weight, "pending"
    config.calibrate(model, batches)                   forward passes; each pending layer's apply
                                                       records stats of its input x, then
                                                       ``finish`` turns stats into per-input-
                                                       channel scales and quantizes
    (or) config.load_calibration_state(saved)          before process_weights_after_loading: the
                                                       saved states quantize without recalibrating
    (or) load a saved directory (serialize.py)         each shard arrives as ``InputScaledRows``
                                                       (quantized rows + s) and is installed as is

A pending layer refuses to run outside calibration (RuntimeError), so a model whose calibration
was forgotten can never silently serve float weights.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.layers.linear import Linear, UnquantizedLinearMethod
from kvforge.quant.base import QuantizationConfig
from kvforge.quant.w8a8_ops import float_weight, take_float_weight

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


class InputSquares:
    """Mean x^2 per input channel of a layer's inputs, summed while ``recording`` is set (the
    statistics of LoRC's ``lorc_act`` and fp4's ``act_aware``)."""

    def init_squares(self) -> None:
        self.recording = False
        self._sq_sum: torch.Tensor | None = None
        self._num_rows = 0

    def record_squares(self, x2d: torch.Tensor, what: str) -> None:
        if not self.recording:
            raise RuntimeError(f"activation-aware {what} layer used before calibration")
        sq = x2d.float().pow(2).sum(dim=0)
        self._sq_sum = sq if self._sq_sum is None else self._sq_sum + sq
        self._num_rows += x2d.shape[0]

    def take_sq_mean(self) -> torch.Tensor | None:
        """The mean so far (None if nothing was recorded), and a fresh start."""
        mean = None if self._num_rows == 0 else self._sq_sum / self._num_rows
        self._sq_sum, self._num_rows = None, 0
        return mean


def calibrate_recording_layers(model, batches: Iterable[Sequence[int]], layers: list) -> None:
    """Run ``batches`` through ``model`` with each of ``layers``' methods recording its inputs
    (``method.recording``), then ``method.finish(layer)`` each: the flow of the methods that
    wait for input statistics outside ``CalibratedLinearMethod`` (LoRC's and fp4's
    activation-aware options)."""
    if not layers:
        return
    for layer in layers:
        layer.method.recording = True
    try:
        run_calibration_forward(model, batches)
    finally:
        for layer in layers:
            layer.method.recording = False
    for layer in layers:
        layer.method.finish(layer)


@dataclass
class InputScaledRows:
    """Saved rows of a calibrated layer: the quantized rows of W * s (``Int4Blocks`` or
    ``Int8Rows``) and the per-input-channel s the layer divides its input by. A reload installs
    them as they are, without recalibrating. Fused layers save s with every shard (one input)."""
    rows: Any
    input_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)


class CalibratedLinearMethod(UnquantizedLinearMethod):
    """Float storage until ``finish(layer, state)`` quantizes; records input statistics while
    its config is calibrating. ``state`` is a dict of tensors with at least ``"scales"`` (s per
    input channel: the layer computes (x / s) @ Q(W * s)^T) plus what else the method chose.

    Subclasses implement ``compute_state`` (stats -> state), ``quantized_rows`` (float W and
    state -> rows of Q(W * s)), ``install`` (create the quantized storage), ``load_rows`` (write
    rows into it), ``export_rows`` (read them back for saving) and ``apply_quantized``. The
    same ``install``/``load_rows`` serve calibration and the reload of saved rows."""

    def __init__(self, config: "CalibratedQuantConfig", prefix: str, max_samples: int = 0) -> None:
        self.config = config
        self.prefix = prefix
        self.max_samples = max_samples          # input rows kept for a search (AWQ); 0 = none
        self.abs_max: torch.Tensor | None = None
        self.abs_sum: torch.Tensor | None = None
        self.num_rows = 0
        self.samples: torch.Tensor | None = None   # [<= max_samples, in], a uniform sample
        self.state: dict[str, torch.Tensor] | None = None   # set when quantized
        self._rows_loaded = 0                   # saved rows installed so far (reload path)
        self._sampler = torch.Generator().manual_seed(0)

    @property
    def quantized(self) -> bool:
        return self.state is not None

    @property
    def scales(self) -> torch.Tensor | None:
        return None if self.state is None else self.state["scales"]

    # ------------------------------------------------------------------ loading
    def load_weight(self, layer, kind, loaded, output_offset):
        if kind == "weight" and isinstance(loaded, InputScaledRows):
            self._load_saved(layer, loaded, output_offset)
        elif kind == "weight" and self.quantized:
            raise ValueError(f"{self.name()} layer {self.prefix!r} is already quantized; got a "
                             f"float weight for it")
        elif kind == "weight" and not isinstance(loaded, torch.Tensor):
            raise ValueError(f"{self.name()} layer {self.prefix!r} got saved rows "
                             f"({type(loaded).__name__}) without their input scales")
        else:
            super().load_weight(layer, kind, loaded, output_offset)

    def _load_saved(self, layer, saved: InputScaledRows, offset: int) -> None:
        scale = saved.input_scale.float()
        if scale.shape != (layer.input_size,):
            raise ValueError(f"saved input scales of shape {tuple(scale.shape)} for "
                             f"{self.prefix!r}, expected ({layer.input_size},)")
        if self.state is None:
            self._install(layer, scale)
            self.state = {"scales": scale.clone()}
        elif not torch.equal(scale, self.state["scales"]):
            raise ValueError(f"shards of {self.prefix!r} were saved with different input scales")
        self.load_rows(layer, saved.rows, offset)
        self._rows_loaded += saved.shape[0]

    def process_weights_after_loading(self, layer):
        saved = self.config.saved_state.get(self.prefix)
        if saved is not None and not self.quantized:
            self.finish(layer, saved)
        if 0 < self._rows_loaded != layer.output_size:
            raise ValueError(f"{self.prefix!r} got {self._rows_loaded} of {layer.output_size} "
                             f"saved weight rows")

    # ------------------------------------------------------------------ calibration
    def record(self, x2d: torch.Tensor) -> None:
        a = x2d.detach().float().abs()
        amax, asum = a.amax(dim=0), a.sum(dim=0)
        self.abs_max = amax if self.abs_max is None else torch.maximum(self.abs_max, amax)
        self.abs_sum = asum if self.abs_sum is None else self.abs_sum + asum
        if self.max_samples:
            self._sample(x2d.detach().float())
        self.num_rows += a.shape[0]

    def _sample(self, x: torch.Tensor) -> None:
        """Reservoir sampling (Algorithm R): after any number of calls every row seen is kept
        with the same probability, so a search sees all calibration windows, not the first."""
        if self.samples is None:
            self.samples = x.new_empty(0, x.shape[1])
        room = self.max_samples - self.samples.shape[0]
        if room > 0:
            self.samples = torch.cat([self.samples, x[:room]])
        seen = self.num_rows + max(room, 0)        # index of x's first row not yet placed
        for i in range(max(room, 0), x.shape[0]):
            j = int(torch.randint(0, seen + 1, (1,), generator=self._sampler))
            if j < self.max_samples:
                self.samples[j] = x[i]
            seen += 1

    def apply(self, layer, x):
        if self.quantized:
            return self.apply_quantized(layer, x)
        if not self.config.calibrating:
            raise RuntimeError(f"{self.config.name} layer {self.prefix!r} used before calibration "
                               f"(call config.calibrate(model, batches) or "
                               f"load_calibration_state)")
        self.record(x.reshape(-1, layer.input_size))
        return super().apply(layer, x)

    def finish(self, layer: Linear, state: dict[str, torch.Tensor] | None = None) -> None:
        if state is None:
            if self.abs_max is None:
                raise RuntimeError(f"layer {self.prefix!r} saw no calibration input")
            state = self.compute_state(layer)
        state = {k: torch.as_tensor(v).float().clone() for k, v in state.items()}
        if "scales" not in state or state["scales"].shape != (layer.input_size,):
            shape = tuple(state["scales"].shape) if "scales" in state else None
            raise ValueError(f"scales of shape {shape} for {self.prefix!r}, expected "
                             f"({layer.input_size},)")
        rows = self.quantized_rows(float_weight(layer), state)
        self._install(layer, state["scales"])
        self.load_rows(layer, rows, 0)
        self.state = state
        self.abs_max = self.abs_sum = self.samples = None

    def _install(self, layer: Linear, scales: torch.Tensor) -> None:
        """Drop the float weight and create the quantized storage, keeping a loaded bias."""
        bias = layer.bias.detach().clone() if layer.has_bias else None
        dtype = float_weight(layer).dtype
        take_float_weight(layer)
        self.install(layer, scales, dtype)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)

    def name(self) -> str:
        return self.config.name

    @abstractmethod
    def compute_state(self, layer: Linear) -> dict[str, torch.Tensor]:
        """Calibration stats -> state: ``"scales"`` [in] (the layer will compute
        (x / s) @ (W * s)^T) and anything else ``quantized_rows`` needs."""

    @abstractmethod
    def quantized_rows(self, weight: torch.Tensor, state: dict[str, torch.Tensor]) -> Any:
        """Float W [out, in] -> the quantized rows of W * s (the form ``load_rows`` takes)."""

    @abstractmethod
    def install(self, layer: Linear, scales: torch.Tensor, dtype: torch.dtype) -> None:
        """Create the quantized storage (the float weight is already gone)."""

    @abstractmethod
    def load_rows(self, layer: Linear, rows: Any, output_offset: int) -> None: ...

    @abstractmethod
    def export_rows(self, layer: Linear) -> Any:
        """The quantized rows in the form ``load_rows`` takes (what a save writes)."""

    @abstractmethod
    def apply_quantized(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...


class CalibratedQuantConfig(QuantizationConfig):
    needs_calibration = True

    def __init__(self) -> None:
        self.calibrating = False
        self.methods: dict[str, CalibratedLinearMethod] = {}
        self.saved_state: dict[str, dict[str, torch.Tensor]] = {}

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

    def calibration_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{layer prefix: state}: what quantizes a float model again without calibrating
        (``state["scales"]`` per input channel, plus method extras such as AWQ's clip ranges;
        a layer reloaded from saved rows knows only its scales: save the directory instead)."""
        return {p: {k: v.clone() for k, v in m.state.items()}
                for p, m in self.methods.items() if m.state is not None}

    def load_calibration_state(self, state: dict[str, dict[str, torch.Tensor] | torch.Tensor]
                               ) -> None:
        """Install saved states (a bare tensor is taken as ``{"scales": tensor}``); call before
        the model's weights are loaded/processed."""
        self.saved_state = {p: dict(v) if isinstance(v, dict) else {"scales": torch.as_tensor(v)}
                            for p, v in state.items()}

    def pending_layers(self) -> list[str]:
        """Prefixes of this config's layers that are not quantized yet."""
        return [p for p, m in self.methods.items() if not m.quantized]
