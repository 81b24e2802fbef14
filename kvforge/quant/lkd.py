"""Layer-wise knowledge distillation (ZeroQuant's LKD) of one quantized linear layer.

The float layer is the teacher, its quantized self the student, both fed the same calibration
inputs x [T, K] (the float model's activations at that layer):

    loss(W') = mean (Qa(x) Qw(W')^T - x W^T)^2

Qw (weight rounding) and Qa (activation rounding) are the method's own quantizers; rounding has
no useful gradient, so it is passed straight through (STE: d Qw(W') / d W' = 1). W' starts at W
(step 0 is plain round-to-nearest) and takes ``steps`` Adam steps whose size ``lr`` is in units
of the layer's mean weight step, so one setting fits layers of any scale. The W' of the lowest
loss seen is returned -- never worse than round-to-nearest on the calibration rows.

ZeroQuant trains a whole transformer block at a time; one linear at a time keeps each problem
small (one [T, K] x [K, n] product per step) and needs no block-level code per model family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Distilled:
    weight: torch.Tensor           # W' [n, K]: quantize this instead of W
    loss: float                    # its loss on the calibration rows
    rtn_loss: float                # the loss of W itself (round-to-nearest)


def distil_weight(weight: torch.Tensor, x: torch.Tensor,
                  fake_quant_weight: Callable[[torch.Tensor], torch.Tensor],
                  fake_quant_input: Callable[[torch.Tensor], torch.Tensor],
                  steps: int, lr: float) -> Distilled:
    with torch.inference_mode(False), torch.enable_grad():
        w0 = weight.detach().float().clone()
        x = x.detach().float().clone()
        target = x @ w0.t()
        xq = fake_quant_input(x)
        # round-to-nearest errors are uniform in +-step/2: their mean magnitude is step / 4
        step = float((fake_quant_weight(w0) - w0).abs().mean()) * 4 or 1e-8
        w = w0.clone().requires_grad_(True)
        opt = torch.optim.Adam([w], lr=lr * step)
        best_w, best_loss, rtn_loss = w0, None, None
        for i in range(steps + 1):
            wq = w + (fake_quant_weight(w.detach()) - w).detach()          # straight-through
            loss = (xq @ wq.t() - target).pow(2).mean()
            value = float(loss.detach())
            if i == 0:
                rtn_loss = value
            if best_loss is None or value < best_loss:
                best_w, best_loss = w.detach().clone(), value
            if i == steps:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
    return Distilled(best_w, best_loss, rtn_loss)
