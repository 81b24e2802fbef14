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
(layer, kind); a threshold is the S-quantile of its sample. Then ``IN_PLACE_PASSES`` more
recordings run with the masks of the last thresholds on, so every input is sampled as it
arrives behind the earlier layers' masks (see ``calibrate``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvforge.sparsity.config import KINDS, validate_sparsity
from kvforge.sparsity.masking import gated_projections
from kvforge.sparsity.rotation import (ROTATED_COORDINATES, CoordinateRotation,
                                      calibrate_rotations)
from kvforge.sparsity.thresholds import SparsityThresholds

CALIBRATION_OFFSET = 8192      # tokens of The Tempest skipped (the eval's text comes first)
CALIBRATION_TOKENS = 4096
WINDOW = 512
SAMPLES_PER_CALL = 32768       # |x| values kept per (layer, kind) per prefill


class _Recorder:
    """Seeded random samples of |input| per (kind, layer); a rotated input's in its axes."""

    def __init__(self, model, mode: str, seed: int = 0,
                 rotations: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.samples: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self._handles = []
        rotations = rotations or {}
        for i, mods in enumerate(gated_projections(model, mode)):
            if mode == "teal":
                for kind in KINDS["teal"]:
                    transform = lambda x: x                                 # noqa: E731
                    if kind in rotations:       # the coordinates as the kernel computes them
                        transform = CoordinateRotation(rotations[kind][i]).coordinates
                    self._handles.append(mods[kind].register_forward_pre_hook(
                        self._hook(kind, i, transform), prepend=True))
            else:
                self._handles.append(mods["act"].register_forward_pre_hook(self._hook(
                    "gate", i, lambda gu: F.silu(gu[..., : gu.shape[-1] // 2])), prepend=True))

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
IN_PLACE_PASSES = 2           # recordings with the masks on (calibrate's comment)
CALIBRATION_VERSION = 3       # cached thresholds of another version are calibrated again
GREEDY_TOKENS = 256           # calibration tokens each candidate is scored on
LEVEL_MAX = 0.95


@torch.inference_mode()
def record_samples(model, token_ids: list[int], mode: str, window: int = WINDOW,
                   rotations: dict[str, list[torch.Tensor]] | None = None
                   ) -> dict[tuple[str, int], torch.Tensor]:
    """(kind, layer) -> an ascending sample of that input's magnitudes (a rotated kind's: of
    its coordinates x Q) over prefills of ``token_ids``."""
    if len(token_ids) < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {len(token_ids)}")
    recorder = _Recorder(model, mode, rotations=rotations)
    try:
        prefill_windows(model, token_ids, window)
    finally:
        recorder.remove()
    return {key: torch.cat(v).sort().values for key, v in recorder.samples.items()}


def prefill_windows(model, token_ids: list[int], window: int = WINDOW) -> None:
    """Prefills of ``token_ids`` in windows of ``window`` tokens (for hooks to watch), with a
    progress bar on a terminal (a first calibration of a 0.5B int8 model takes minutes)."""
    from tqdm import tqdm
    from kvforge.eval.perplexity import window_nll
    for start in tqdm(range(0, len(token_ids), window), desc="sparsity calibration prefills",
                      unit="window", leave=False, disable=None):
        piece = token_ids[start:start + window]
        if len(piece) >= 2:
            window_nll(model, piece)


def thresholds_at(samples, levels: dict[str, float], num_layers: int) -> dict[str, list[float]]:
    return {kind: [quantile(samples[(kind, i)], level) for i in range(num_layers)]
            for kind, level in levels.items()}


def weight_shares(model) -> dict[str, float]:
    """Each kind's fraction of a layer's projection weights."""
    mods = gated_projections(model)[0]
    sizes = {k: mods[k].input_size * mods[k].output_size for k in KINDS["teal"]}
    total = sum(sizes.values())
    return {k: v / total for k, v in sizes.items()}


@torch.inference_mode()
def greedy_levels(model, samples, eval_ids: list[int], sparsity: float,
                  step: float = GREEDY_STEP,
                  rotations: dict[str, list[torch.Tensor]] | None = None) -> dict[str, float]:
    """Per-kind levels whose weight-weighted mean is ``sparsity`` (see the module doc)."""
    from kvforge.eval.perplexity import window_nll
    from kvforge.sparsity.masking import SparsityMasks
    num_layers = len(gated_projections(model))
    shares = weight_shares(model)
    levels = {k: 0.0 for k in KINDS["teal"]}

    def nll(lv):
        t = SparsityThresholds("teal", sparsity, thresholds_at(samples, lv, num_layers),
                               rotations=rotations or {})
        with SparsityMasks(model, t):
            total, n = window_nll(model, eval_ids)
        return total / n

    from tqdm import tqdm
    bar = tqdm(total=math.ceil(sparsity / step - 1e-9), desc="sparsity greedy allocation",
               unit="round", leave=False, disable=None)
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
        bar.update(1)
    bar.close()
    return levels


@torch.inference_mode()
def calibrate(model, token_ids: list[int], sparsity: float, mode: str = "teal",
              allocation: str = "uniform", window: int = WINDOW,
              info: dict | None = None, rotation: str = "none",
              rotations: dict[str, list[torch.Tensor]] | None = None) -> SparsityThresholds:
    """Thresholds for ``model`` at target ``sparsity`` from prefills over ``token_ids``; with
    rotation "pca", in the principal axes ``rotations`` (computed here when None)."""
    validate_sparsity(sparsity, mode, allocation, rotation)
    if rotation == "pca" and rotations is None:
        rotations = calibrate_rotations(model, token_ids, window)
    rotations = rotations if rotation == "pca" else {}
    samples = record_samples(model, token_ids, mode, window, rotations)
    num_layers = len(gated_projections(model))
    if mode == "teal" and allocation == "greedy" and sparsity > 0:
        levels = greedy_levels(model, samples, token_ids[:GREEDY_TOKENS], sparsity,
                               rotations=rotations)
    else:
        levels = {kind: float(sparsity) for kind in KINDS[mode]}
        allocation = "uniform"
    paying = {kind: qs for kind, qs in rotations.items() if rotation_pays(model, kind, levels[kind])}
    if paying.keys() != rotations.keys():             # those inputs thresholded as they are
        rotations = paying
        samples = record_samples(model, token_ids, mode, window, rotations)
    thresholds = SparsityThresholds(
        mode, float(sparsity), thresholds_at(samples, levels, num_layers),
        dict(info or {}, tokens=len(token_ids), window=window, allocation=allocation,
             levels=levels, rotation=rotation, rotated=sorted(rotations),
             version=CALIBRATION_VERSION,
             **({"coordinates": ROTATED_COORDINATES} if rotations else {})),
        rotations=rotations)
    # In place: a layer's input is thresholded after every earlier layer's masks, whose errors
    # raise its small entries (most of all a rotated input's low-variance axes: on SmolLM2 at
    # a 50% level, dense thresholds realised 48-49% plain and 38% rotated on the scored text,
    # these passes 49.5-50% and 43%). Each pass records the inputs with the previous pass's
    # masks on (the recorder's hooks run before the masks) and re-takes the quantiles.
    for _ in range(IN_PLACE_PASSES if sparsity > 0 else 0):
        from kvforge.sparsity.masking import SparsityMasks
        with SparsityMasks(model, thresholds):
            samples = record_samples(model, token_ids, mode, window, rotations)
        thresholds.layers = thresholds_at(samples, levels, num_layers)
    return thresholds


def rotation_pays(model, kind: str, level: float) -> bool:
    """Whether rotating ``kind``'s input can repay its d x d product: the weight rows a level
    skips (level x d rows of the projection's outputs) must outweigh the d x d rotation. Below
    that (a greedy allocation may give gate|up ~10%) the input is thresholded as it is."""
    mods = gated_projections(model)[0]
    return level * mods[kind].output_size > mods[kind].input_size


def calibration_tokens(tokenizer, offset: int = CALIBRATION_OFFSET,
                       count: int = CALIBRATION_TOKENS) -> list[int]:
    """``count`` tokens of The Tempest from ``offset`` (fewer when the text ends first)."""
    from kvforge.eval.corpus import shakespeare_text
    ids = tokenizer.encode(shakespeare_text(), add_special_tokens=False)
    if len(ids) <= offset + 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens; offset {offset} "
                         f"leaves none")
    return ids[offset:offset + count]
