"""TEAL in principal axes (``--activation-sparsity-rotation pca``; training-free, after LaRoSA).

For a projection y = W x and an orthogonal Q (Q Q^T = I), y = (W Q)(Q^T x). With Q's columns the
principal axes of x on calibration text (eigenvectors of E[x x^T], largest variance first), a
few coordinates of Q^T x carry most of its energy: on SmolLM2-135M the top half of the axes of
gate|up's input hold 95-99% of it, where x's own entries are spread far more evenly. Zeroing the
smallest-magnitude coordinates of Q^T x then loses much less than zeroing the smallest entries
of x, and the skipped weights are rows of (W Q)^T exactly as before:

    x --(x Q: dense, d x d)--> x' --(|x'| > t)--> kept rows of (W Q)^T --> y

Rotated: gate|up's input (the MLP's RMSNorm output), ``ROTATED_KINDS``. Measured on
SmolLM2-135M fp32 (perplexity over 2,048 Tempest tokens, one kind at S = 0.5, the others dense):
gate|up +48.8% -> +1.7%. Not rotated, each for a measured reason: q|k|v's input (+6.0% ->
+5.6% alone; with every kind at S = 0.5 over 4,096 tokens +13.6% -> +10.5%, but at S = 0.4
+2.9% -> +4.9%: no steady gain for another d x d product), o's (per-head attention outputs:
+0.25% plain, no gain rotated) and down's (+2.3% -> +0.7%, but its rotation is an I x I
product, 1536^2 on the 135M: more than the sparse product it would serve).

Cost: x Q is one dense d x d product per layer and decode step (576^2 on the 135M, ~9% of a
layer's weights in fp32), paid where the skipped rows save more. It is an integer product
(``CoordinateRotation``: int8 Q per column, x rounded to int8 per group of 64 inputs, the
W8A8 kernel's dots), ~12 us a layer on the 135M as AVX2 where converting int8 Q to fp32 for
FMAs takes ~50. The decode twin keeps W Q (fp32, or beside int8 weights int8 requantized per
output row); the model's own weights, used by prefill, are untouched, so S = 0 and prefill
are exactly as without rotation.

Thresholds in these axes transfer less well to other text than plain ones: on SmolLM2 at a
50% level gate|up's rotated input is 46% zeroed on Tempest but 32% on ShareGPT answers (plain:
49% / 49%), since the axes quiet on Shakespeare carry more elsewhere. Keeping exactly the top
half per token instead (top-k) holds the level everywhere but cost far more quality (+18% /
+73% perplexity on Tempest / ShareGPT vs +9.5% / +19% thresholded), so thresholds stay.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.sparsity.masking import gated_projections

# inputs rotated under "pca" (the module docstring says why only gate|up's)
ROTATED_KINDS = ("gate_up",)
# calibration tokens the axes are fitted on: more than the thresholds' 4,096, since the
# low-variance axes of a covariance fitted on few tokens are too quiet on other text (on the
# 135M the rotated input realised 43% at a 50% level from 4,096 tokens, 46% from 16,384)
ROTATION_TOKENS = 16384


@torch.inference_mode()
def input_covariances(model, token_ids: list[int], kinds=ROTATED_KINDS,
                      window: int = 512) -> dict[tuple[str, int], torch.Tensor]:
    """(kind, layer) -> E[x x^T] (float64 [d, d]) of that projection's input over prefills of
    ``token_ids`` in windows of ``window`` tokens."""
    from kvforge.sparsity.calibrate import prefill_windows
    if len(token_ids) < 2:
        raise ValueError(f"rotation calibration needs at least 2 tokens, got {len(token_ids)}")
    sums: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[tuple[str, int], int] = {}

    def hook(key):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[key] = sums[key] + x.T @ x if key in sums else x.T @ x
            counts[key] = counts.get(key, 0) + x.shape[0]
        return record

    handles = [mods[kind].register_forward_pre_hook(hook((kind, i)))
               for i, mods in enumerate(gated_projections(model)) for kind in kinds]
    try:
        prefill_windows(model, token_ids, window)
    finally:
        for h in handles:
            h.remove()
    return {key: sums[key].cpu() / counts[key] for key in sums}


def principal_axes(covariance: torch.Tensor) -> torch.Tensor:
    """Q [d, d] float32, orthogonal: its columns the eigenvectors of ``covariance``, largest
    eigenvalue first (the order only makes the matrix easier to read)."""
    if covariance.dim() != 2 or covariance.shape[0] != covariance.shape[1]:
        raise ValueError(f"a covariance must be square, got {tuple(covariance.shape)}")
    _, vectors = torch.linalg.eigh(covariance.double())
    return vectors.flip(-1).float().contiguous()


def calibrate_rotations(model, token_ids: list[int], window: int = 512
                        ) -> dict[str, list[torch.Tensor]]:
    """kind -> one Q per layer, for every kind in ROTATED_KINDS."""
    cov = input_covariances(model, token_ids, ROTATED_KINDS, window)
    num_layers = len(gated_projections(model))
    return {kind: [principal_axes(cov[(kind, i)]) for i in range(num_layers)]
            for kind in ROTATED_KINDS}


def save_rotations(path: Path, rotations: dict[str, list[torch.Tensor]]) -> None:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({f"{kind}.{i}": q.contiguous() for kind, qs in rotations.items()
               for i, q in enumerate(qs)}, str(tmp))
    tmp.replace(path)               # atomic: a concurrent reader never sees half a file


def load_rotations(path: Path, num_layers: int) -> dict[str, list[torch.Tensor]] | None:
    """The rotations saved at ``path`` for a model of ``num_layers`` layers; None when absent,
    damaged or made for another shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not path.is_file():
        return None
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError):
        return None
    out = {}
    for kind in ROTATED_KINDS:
        qs = [tensors.get(f"{kind}.{i}") for i in range(num_layers)]
        if any(q is None or q.dim() != 2 or q.shape[0] != q.shape[1] for q in qs):
            return None
        out[kind] = qs
    return out


# inputs per activation step of the coordinates' integer product: x is rounded to int8 in
# groups of this many inputs, each with its own step (max |x| of the group -> 127). The
# RMSNorm output rotated here has a few channels ~50x the rest; one step per row would round
# the others to a handful of levels
ROTATION_ACT_GROUP = 64
# how rotated coordinates are computed, kept with thresholds calibrated on them: cached rotated
# thresholds made another way (fp32 x times int8 Q) are calibrated again
ROTATED_COORDINATES = f"int8 x per {ROTATION_ACT_GROUP} inputs, int8 Q per column"


def kernel_rotation(rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q as the kernel reads it to compute the coordinates: int8 with a scale per column of Q
    (a quarter of fp32's bytes: an fp32 Q added ~18% to the reads of SmolLM2's sparse decode
    step at S = 0.5 and cost a fifth of its speed-up). The rounding (~0.4% of an entry) moves
    coordinates by ~0.3%; the weights they multiply are W Q with the exact Q."""
    from kvforge.quant.packing import quantize_int8_per_channel
    q, s = quantize_int8_per_channel(rotation.float().T)      # rows = Q's columns
    return q.T.contiguous(), s.float()


class CoordinateRotation:
    """The coordinates c = x Q of a rotated input as the decode kernel computes them
    (csrc/sparse_gemv.cpp, with csrc/w8a8_gemm.cpp's integer product): Q in int8 with a scale
    per column (``kernel_rotation``), x rounded to int8 per group of ``group`` inputs (round
    half even, step = max |x| / 127: the W8A8 kernel's rounding), exact integer sums per group,
    rescaled and added over the groups in fp32. An integer dot takes 32 products in 1
    instruction with VNNI and 4 with AVX2 where converting int8 Q to fp32 first took ~3 per 8.
    The masks (masking.py) and calibration (calibrate.py) use ``coordinates`` so that all three
    threshold the same numbers.

        x [rows, d] --pad--> [rows, groups, group] --round(x / step)--> int8
        c[r, j] = sum over groups g of  step[r, g] * s[j] * sum_{k in g} x8[r, k] * q[k, j]
    """

    def __init__(self, rotation: torch.Tensor) -> None:
        self.codes, self.scales = kernel_rotation(rotation)          # [d, d] input-major, [d]
        self.dim = self.codes.shape[0]
        self.group = (ROTATION_ACT_GROUP if self.dim >= ROTATION_ACT_GROUP
                      else -(-self.dim // 4) * 4)
        self.padded = -(-self.dim // self.group) * self.group
        # Q's rows in the groups of x they multiply: [groups, group, d] int8
        self._grouped_codes = F.pad(self.codes, (0, 0, 0, self.padded - self.dim)).view(
            -1, self.group, self.dim)

    def coordinates(self, x: torch.Tensor) -> torch.Tensor:
        from kvforge.quant.w8a8_ops import exact_float_matmul
        from kvforge.quant.zeroquant import quantize_int8_groups
        rows = x.reshape(-1, self.dim)
        x8, step = quantize_int8_groups(rows, self.group)      # [r, groups, group], [r, groups]
        sums = exact_float_matmul(x8.transpose(0, 1), self._grouped_codes.to(x.device))
        coords = (sums.float() * self.scales.to(x.device)) * step.T[..., None]
        return coords.sum(dim=0).reshape(*x.shape[:-1], self.dim).to(x.dtype)

    def panels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q^T in the W8A8 kernel's panels (``pack_w8a8_panels``: output j is coordinate j, Q's
        column scale repeated for every group): codes, scales, code sums."""
        from kvforge.kernels.ops import pack_w8a8_panels
        codes = F.pad(self.codes.T, (0, self.padded - self.dim)).contiguous()   # [d, Kp]
        scales = self.scales[:, None].expand(self.dim, self.padded // self.group).contiguous()
        return pack_w8a8_panels(codes, scales)


def kernel_rotations(ops, rotations: list[torch.Tensor]) -> list:
    """The compiled x -> coordinates product of each rotation (``ops.W8A8Projection``), their
    panels in huge-page buffers in layer order (kernels/huge_pages.py), like the decode twins
    (on the 1.5B the 28 layers' Q are 66 MB, read every decode step)."""
    from kvforge.kernels.huge_pages import huge_page_zeros
    if not rotations:
        return []
    parts = [CoordinateRotation(q) for q in rotations]
    packed = [r.panels() for r in parts]
    buffers = [huge_page_zeros([tuple(p[i].shape) for p in packed], packed[0][i].dtype, "cpu")
               for i in range(3)]
    out = []
    for r, tensors, *resident in zip(parts, packed, *buffers):
        for dst, src in zip(resident, tensors):
            dst.copy_(src)
        out.append(ops.W8A8Projection(*resident, r.dim, r.dim))
    return out


def rotated_rows(weight: torch.Tensor, scales: torch.Tensor | None, rotation: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W Q for a decode twin: fp32 [out, in] -> fp32; int8 codes with per-output scales ->
    the rotated weight requantized to int8 per output row (its own rounding: W Q is not on
    the original codes' grid)."""
    if scales is None:
        return weight.float() @ rotation, None
    from kvforge.quant.packing import quantize_int8_per_channel
    rotated = (weight.float() * scales.float()[:, None]) @ rotation
    q, s = quantize_int8_per_channel(rotated)
    return q, s.float()
