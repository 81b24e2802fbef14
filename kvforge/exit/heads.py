"""Exit heads (LITE / Kangaroo style): after the first ``E`` decoder layers, a light head maps the
residual stream to the space the model's final norm outputs, so the model's OWN LM head turns
it into logits:

    stream_E --RMSNorm(w_E)--> x --A_E (d x d)--> z        logits = lm_head(z)

``w_E`` starts as the final norm's weight and ``A_E`` as the identity, so an untrained head is
the plain self-draft exit (final norm + LM head at layer E); distillation (exit/train.py) then
moves ``z`` towards what the full model would have produced. The head costs d^2 + d
multiply-adds per token; the LM head it feeds costs vocab x d (the price of an exit check).
Plain torch ops, so the same module trains (autograd) and runs in the engine.
"""
from __future__ import annotations

import torch
from torch import nn


class ExitHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, norm_weight: torch.Tensor | None = None
                 ) -> None:
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden_size) if norm_weight is None
                                        else norm_weight.detach().float().clone())
        self.adapter = nn.Parameter(torch.eye(hidden_size))

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        """[T, d] residual stream after layer E -> [T, d] input of the LM head."""
        x = stream.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return nn.functional.linear(x, self.adapter).to(stream.dtype)


class ExitHeads(nn.Module):
    """One ExitHead per exit layer E (exit after the first E decoder layers, 1 <= E < L)."""

    def __init__(self, layers: list[int], num_layers: int, hidden_size: int, eps: float,
                 norm_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.layers = validate_exit_layers(layers, num_layers)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.heads = nn.ModuleDict({str(e): ExitHead(hidden_size, eps, norm_weight)
                                    for e in self.layers})

    def __getitem__(self, layer: int) -> ExitHead:
        if layer not in self.layers:
            raise KeyError(f"no exit head after layer {layer}; trained: {self.layers}")
        return self.heads[str(layer)]

    @classmethod
    def for_model(cls, model, layers: list[int]) -> "ExitHeads":
        """Heads for a Llama-family or Gemma 3 ``model``, initialised to its final norm (see
        module doc)."""
        from kvforge.models.layerwise import layerwise_family
        family = layerwise_family(type(model), "early exit")
        norm = model.model.norm
        return cls(layers, model.num_layers, model.config.hidden_size, norm.eps,
                   family.final_norm_scale(model.model))


def default_exit_layers(num_layers: int) -> list[int]:
    """Exits after 1/4, 1/2, 5/8 and 3/4 of the layers (30 layers: 8, 15, 19, 22): deep enough
    to be confident often, few enough that failed checks (an LM head each) stay cheap."""
    return sorted({max(1, min(num_layers - 1, round(num_layers * f)))
                   for f in (0.25, 0.5, 0.625, 0.75)})


def validate_exit_layers(layers, num_layers: int) -> list[int]:
    layers = sorted(set(int(e) for e in layers))
    if not layers:
        raise ValueError("no exit layers given")
    bad = [e for e in layers if not 1 <= e < num_layers]
    if bad:
        raise ValueError(f"exit layers must be in [1, {num_layers - 1}] for a {num_layers}-layer "
                         f"model (exit after the first E layers), got {bad}")
    return layers
