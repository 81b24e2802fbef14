"""Per-layer thresholds from activation statistics on shipped text.

Allocation of the target S (TEAL): ``uniform`` zeroes the same fraction S of every thresholded
input; ``greedy`` gives each kind of projection (q|k|v, o, gate|up, down) its own level,
chosen by a greedy search like TEAL's: starting dense, each round raises the level of the kind
whose increase costs the least calibration NLL per weight byte skipped, in steps that skip 5%
more of the layers' weights, until the weights skipped reach S. Model-wide S is then the
fraction of the layers' projection weights skipped (what decode speed follows); with uniform
levels the two definitions agree. CATS thresholds its MLP channels at S.

The text is The Tempest (``eval/corpus.py``), from token ``CALIBRATION_OFFSET`` on: past the
first 4,096 tokens that ``kvforge eval perplexity`` scores by default, so calibration and
evaluation do not share text. A few prefills of ``window`` tokens run through the model's
Python layers with hooks that keep a seeded random sample of each input's magnitudes per
(layer, kind); a threshold is the S-quantile of its sample.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.sparsity.config import KINDS, validate_sparsity
from kvforge.sparsity.masking import llama_projections
from kvforge.sparsity.thresholds import SparsityThresholds

CALIBRATION_OFFSET = 8192      # tokens of The Tempest skipped (the eval's text comes first)
CALIBRATION_TOKENS = 4096
WINDOW = 512
SAMPLES_PER_CALL = 32768       # |x| values kept per (layer, kind) per prefill


class _Recorder:
    """Seeded random samples of |input| per (kind, layer)."""

    def __init__(self, model, mode: str, seed: int = 0) -> None:
        self.samples: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self._handles = []
        for i, mods in enumerate(llama_projections(model)):
            if mode == "teal":
                for kind in KINDS["teal"]:
                    self._handles.append(mods[kind].register_forward_pre_hook(
                        self._hook(kind, i, lambda x: x)))
            else:
                self._handles.append(mods["act"].register_forward_pre_hook(self._hook(
                    "gate", i, lambda gu: F.silu(gu[..., : gu.shape[-1] // 2]))))

    def _hook(self, kind: str, layer: int, transform):
        def hook(module, args):
            values = transform(args[0]).detach().abs().float().reshape(-1)
            if values.numel() > SAMPLES_PER_CALL:
                pick = torch.randint(values.numel(), (SAMPLES_PER_CALL,), generator=self.gen)
                values = values[pick]
            self.samples.setdefault((kind, layer), []).append(values.cpu())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def quantile(sorted_values: torch.Tensor, q: float) -> float:
    """The q-quantile (lower) of an ascending sample: zeroing |x| <= it zeroes a q fraction
    of the sample. q = 0: threshold 0 (only exact zeros skipped)."""
    if q <= 0:
        return 0.0
    k = max(1, int(round(q * sorted_values.numel())))
    return float(sorted_values[k - 1])


GREEDY_STEP = 0.05            # weights skipped added per greedy round
GREEDY_TOKENS = 256           # calibration tokens each candidate is scored on
LEVEL_MAX = 0.95


@torch.inference_mode()
def record_samples(model, token_ids: list[int], mode: str,
                   window: int = WINDOW) -> dict[tuple[str, int], torch.Tensor]:
    """(kind, layer) -> an ascending sample of that input's magnitudes over prefills of
    ``token_ids``."""
    from kvforge.eval.perplexity import window_nll
    if len(token_ids) < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {len(token_ids)}")
    recorder = _Recorder(model, mode)
    try:
        for start in range(0, len(token_ids), window):
            piece = token_ids[start:start + window]
            if len(piece) >= 2:
                window_nll(model, piece)
    finally:
        recorder.remove()
    return {key: torch.cat(v).sort().values for key, v in recorder.samples.items()}


def thresholds_at(samples, levels: dict[str, float], num_layers: int) -> dict[str, list[float]]:
    return {kind: [quantile(samples[(kind, i)], level) for i in range(num_layers)]
            for kind, level in levels.items()}


def weight_shares(model) -> dict[str, float]:
    """Each kind's fraction of a layer's projection weights."""
    mods = llama_projections(model)[0]
    sizes = {k: mods[k].input_size * mods[k].output_size for k in KINDS["teal"]}
    total = sum(sizes.values())
    return {k: v / total for k, v in sizes.items()}


@torch.inference_mode()
def greedy_levels(model, samples, eval_ids: list[int], sparsity: float,
                  step: float = GREEDY_STEP) -> dict[str, float]:
    """Per-kind levels whose weight-weighted mean is ``sparsity`` (see the module doc)."""
    from kvforge.eval.perplexity import window_nll
    from kvforge.sparsity.masking import SparsityMasks
    num_layers = len(llama_projections(model))
    shares = weight_shares(model)
    levels = {k: 0.0 for k in KINDS["teal"]}

    def nll(lv):
        t = SparsityThresholds("teal", sparsity, thresholds_at(samples, lv, num_layers))
        with SparsityMasks(model, t):
            total, n = window_nll(model, eval_ids)
        return total / n

    current = nll(levels)
    while (skipped := sum(shares[k] * levels[k] for k in levels)) < sparsity - 1e-9:
        gain = min(step, sparsity - skipped)          # weights skipped this round
        best = None
        for kind in levels:
            level = min(LEVEL_MAX, levels[kind] + gain / shares[kind])
            if level <= levels[kind] + 1e-9:
                continue
            candidate = dict(levels, **{kind: level})
            cost = (nll(candidate) - current) / (shares[kind] * (level - levels[kind]))
            if best is None or cost < best[0]:
                best = (cost, candidate)
        if best is None:                              # every kind at LEVEL_MAX
            break
        levels = best[1]
        current = nll(levels)
    return levels


@torch.inference_mode()
def calibrate(model, token_ids: list[int], sparsity: float, mode: str = "teal",
              allocation: str = "uniform", window: int = WINDOW,
              info: dict | None = None) -> SparsityThresholds:
    """Thresholds for ``model`` at target ``sparsity`` from prefills over ``token_ids``."""
    validate_sparsity(sparsity, mode, allocation)
    samples = record_samples(model, token_ids, mode, window)
    num_layers = len(llama_projections(model))
    if mode == "teal" and allocation == "greedy" and sparsity > 0:
        levels = greedy_levels(model, samples, token_ids[:GREEDY_TOKENS], sparsity)
    else:
        levels = {kind: float(sparsity) for kind in KINDS[mode]}
        allocation = "uniform"
    return SparsityThresholds(mode, float(sparsity), thresholds_at(samples, levels, num_layers),
                              dict(info or {}, tokens=len(token_ids), window=window,
                                   allocation=allocation, levels=levels))


def calibration_tokens(tokenizer, offset: int = CALIBRATION_OFFSET,
                       count: int = CALIBRATION_TOKENS) -> list[int]:
    """``count`` tokens of The Tempest from ``offset`` (fewer when the text ends first)."""
    from kvforge.eval.corpus import shakespeare_text
    ids = tokenizer.encode(shakespeare_text(), add_special_tokens=False)
    if len(ids) <= offset + 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens; offset {offset} "
                         f"leaves none")
    return ids[offset:offset + count]
