"""TEAL in principal axes (kvforge/sparsity/rotation.py): the axes, the rotated sparse kernel
against PyTorch math on both ISA builds, the engine's rotated decode against the masked Python
layers, the options and the cache."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.sparsity.calibrate import calibrate
from kvforge.sparsity.rotation import (ROTATED_KINDS, ROTATION_ACT_GROUP, CoordinateRotation,
                                      kernel_rotations, principal_axes, rotated_rows)
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.kernels.test_w8a8_gemm import dots_of
from tests.sparsity.test_sparse_decode import (_llm, assert_int8_stack_near_masked_layers,
                                               assert_stack_equals_masked_layers)
from tests.sparsity.test_sparse_kernels import _threshold
from tests.sparsity.test_sparse_kernels import compiled  # noqa: F401 (the per-ISA fixture)


def _anisotropic(n: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples whose variance falls off along d random orthogonal axes (returned too)."""
    g = torch.Generator().manual_seed(seed)
    axes = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    scales = torch.logspace(1, -2, d)
    return (torch.randn(n, d, generator=g) * scales) @ axes.T, axes


def test_principal_axes_are_orthogonal_and_ordered():
    x, axes = _anisotropic(4000, 48)
    q = principal_axes(x.double().T @ x.double() / x.shape[0])
    torch.testing.assert_close(q.T @ q, torch.eye(48), rtol=0, atol=1e-5)
    variances = (x @ q).var(dim=0)
    assert torch.all(variances[:-1] >= variances[1:] * 0.999)
    assert abs(float(q[:, 0] @ axes[:, 0])) > 0.99          # the dominant axis found
    with pytest.raises(ValueError, match=r"square, got \(3, 4\)"):
        principal_axes(torch.zeros(3, 4))


def test_masking_in_principal_axes_loses_less():
    """The premise: zeroing half the coordinates of x Q keeps more of x than zeroing half of
    x's own entries (by magnitude, per row)."""
    x, _ = _anisotropic(2000, 64, seed=1)
    mixed = x @ torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)))[0]
    q = principal_axes(mixed.double().T @ mixed.double() / mixed.shape[0])

    def half_error(v):
        t = v.abs().median(dim=1, keepdim=True).values
        return float(((v * (v.abs() <= t)) ** 2).sum() / (v ** 2).sum())
    assert half_error(mixed @ q) < 0.2 * half_error(mixed)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("shape", [(960, 576), (45, 37)])        # (out, in)
@pytest.mark.parametrize("int8", [False, True])
def test_rotated_sparse_projection(compiled, rows, shape, int8):
    """The kernel's coordinates are CoordinateRotation's (to float rounding, with every int8
    dot this CPU runs) and its output the masked coordinates times W Q; at threshold 0 that is
    W x again, up to the int8 rounding of Q and of x."""
    torch.manual_seed(rows + shape[1])
    out, k = shape
    w, b, x = torch.randn(out, k), torch.randn(out), torch.randn(rows, k)
    x[:, 3] *= 30                                       # an outlier channel, as RMSNorm's have
    q = torch.linalg.qr(torch.randn(k, k))[0].contiguous()
    scales = None
    if int8:
        from kvforge.quant.packing import quantize_int8_per_channel
        w, s = quantize_int8_per_channel(w)
        scales = s.float()
    wq, sq = rotated_rows(w, scales, q)
    dense_wq = wq.float() if sq is None else wq.float() * sq[:, None]
    rotation = CoordinateRotation(q)
    assert rotation.codes.dtype == torch.int8
    coords = rotation.coordinates(x)
    exact = x @ q
    assert (coords - exact).abs().max() < 0.03 * exact.abs().max()
    t = _threshold(coords, 0.5)
    w_dense = w.float() if scales is None else w.float() * scales[:, None]
    tol = 0.03 * float((x @ w_dense.t()).abs().max()) * (1 if scales is None else 2.5)
    product = kernel_rotations(compiled, [q])[0]
    for name, dot in dots_of(compiled):
        sp = compiled.SparseProjection(wq.t().contiguous(), t, scales=sq, bias=b, rotation=product,
                                       rotation_dot=dot)
        assert sp.rotated
        masked = (coords * (coords.abs() > t)) @ dense_wq.t() + b
        torch.testing.assert_close(sp.forward(x), masked, rtol=1e-4, atol=2e-3, msg=name)
        full = compiled.SparseProjection(wq.t().contiguous(), 0.0, scales=sq, bias=b,
                                         rotation=product, rotation_dot=dot)
        torch.testing.assert_close(full.forward(x), x @ w_dense.t() + b, rtol=0, atol=tol,
                                   msg=name)


def test_coordinates_round_x_per_group():
    """CoordinateRotation rounds x to int8 per group of ROTATION_ACT_GROUP inputs: an outlier
    coarsens only its own group, and with Q = I (exact in int8) each coordinate is x rounded
    to its group's step (times Q's int8 scale, 1/127 held in fp16: within 1e-4)."""
    g = ROTATION_ACT_GROUP
    x = torch.randn(2, 2 * g)
    x[0, 0] = 100.0
    coords = CoordinateRotation(torch.eye(2 * g)).coordinates(x)
    for r in range(2):
        for i in range(2):
            part = x[r, i * g:(i + 1) * g]
            step = part.abs().max() / 127
            torch.testing.assert_close(coords[r, i * g:(i + 1) * g],
                                       torch.round(part / step) * step, rtol=2e-4, atol=0)
    # the outlier's group is rounded coarsely, the other group finely
    assert (coords[0, g:] - x[0, g:]).abs().max() < 0.05 * (coords[0, 1:g] - x[0, 1:g]).abs().max()


@needs_kernels
def test_kernel_rotations_compute_each_layers_coordinates(compiled):
    """One call packs every layer's Q (in shared huge-page buffers when large enough); each
    compiled product gives that layer's CoordinateRotation coordinates."""
    d = 576                                   # 3 layers x 576^2 int8: past one 2 MiB page
    g = torch.Generator().manual_seed(5)
    qs = [torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(3)]
    x = torch.randn(2, d, generator=g)
    x[:, 7] *= 40
    for q, product in zip(qs, kernel_rotations(compiled, qs)):
        expected = CoordinateRotation(q).coordinates(x)
        for name, dot in dots_of(compiled):
            torch.testing.assert_close(product.forward(x, True, dot), expected, rtol=1e-5,
                                       atol=1e-5 * float(expected.abs().max()), msg=name)


@needs_kernels
def test_bad_rotations_are_refused(compiled):
    w_t = torch.randn(8, 16)                      # input-major: 8 inputs, 16 outputs
    wrong = kernel_rotations(compiled, [torch.eye(16)])[0]
    with pytest.raises(RuntimeError, match="rotation must map 8 inputs to as many coordinates, "
                                           "got 16 -> 16"):
        compiled.SparseProjection(w_t, 0.1, rotation=wrong)
    right = kernel_rotations(compiled, [torch.eye(8)])[0]
    with pytest.raises(RuntimeError, match="rotation_dot 7 is not an int8 dot"):
        compiled.SparseProjection(w_t, 0.1, rotation=right, rotation_dot=7)
    assert compiled.SparseProjection(w_t, 0.1, rotation=right).rotated
    assert not compiled.SparseProjection(w_t, 0.1).rotated


def _rotated_thresholds(llm, sparsity):
    ids = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    return calibrate(llm.engine.runner.model, ids, sparsity, "teal", window=200, rotation="pca")


@needs_kernels
@pytest.mark.parametrize("steps", [1, 4])            # one-step and multi-step decoding
def test_rotated_stack_equals_masked_python_layers(tiny_model_factory, monkeypatch, steps):
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir, num_decode_steps=steps)
    thresholds = _rotated_thresholds(llm, 0.5)
    assert set(thresholds.rotations) == set(ROTATED_KINDS)
    assert thresholds.calibration["rotation"] == "pca"
    assert_stack_equals_masked_layers(llm, thresholds, monkeypatch)


@needs_kernels
def test_rotated_int8_stack_runs_sparse(tiny_model_factory, monkeypatch):
    """int8 twins hold W Q requantized: close to the masked int8 Python layers (their own
    rounding apart), and far from the dense engine."""
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir, quantization="int8")
    assert_int8_stack_near_masked_layers(llm, _rotated_thresholds(llm, 0.5), monkeypatch)


def test_rotated_thresholds_reach_the_target(tiny_model_factory):
    """On the calibration text the rotated input's realised sparsity is the target."""
    from kvforge.eval.perplexity import window_nll
    from kvforge.sparsity.masking import SparsityMasks
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir)
    model = llm.engine.runner.model
    ids = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    thresholds = calibrate(model, ids, 0.4, "teal", window=200, rotation="pca")
    with SparsityMasks(model, thresholds) as masks, torch.inference_mode():
        for start in range(0, 600, 200):
            window_nll(model, ids[start:start + 200])
    for kind, share in masks.realised().items():
        if ":" not in kind:
            assert abs(share - 0.4) < 0.03, (kind, share)


@pytest.mark.parametrize("kwargs,message", [
    ({"activation_sparsity_rotation": "hadamard"}, r"none, pca, got 'hadamard'"),
    ({"activation_sparsity": 0.5, "activation_sparsity_mode": "cats",
      "activation_sparsity_rotation": "pca"}, r"mode 'cats' thresholds silu\(gate\)"),
])
def test_config_rejects_bad_rotation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_cli_flag_reaches_the_config():
    import argparse
    from kvforge.cli import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--activation-sparsity", "0.5", "--activation-sparsity-rotation", "pca"])
    assert EngineConfig(**engine_kwargs(args)).activation_sparsity_rotation == "pca"
    assert EngineConfig().activation_sparsity_rotation == "none"


def test_rotations_cached_once_per_model(tiny_model_factory, tmp_path, monkeypatch):
    import kvforge.sparsity.calibrate as calibrate_mod
    import kvforge.sparsity.rotation as rotation_mod
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    from kvforge.sparsity import cache
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    ids = torch.randint(3, 1000, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(calibrate_mod, "calibration_tokens", lambda tok, **kw: ids)
    hf_dir, _ = tiny_model_factory("llama")
    source = load_model_source(hf_dir)
    model = load_model(source, quantization="none")
    first = cache.load_or_calibrate(model, source, 0.5, "teal", "none", "uniform",
                                    rotation="pca")
    names = sorted(f.name for f in (tmp_path / "sparsity").rglob("*.*"))
    assert names == ["rotations-pca.safetensors", "teal-uniform-pca-S0.500.json"]
    again = cache.load_or_calibrate(model, source, 0.5, "teal", "none", "uniform",
                                    rotation="pca")
    assert again.layers == first.layers
    for a, b in zip(again.rotations["gate_up"], first.rotations["gate_up"]):
        assert torch.equal(a, b)

    def fail(*a, **k):
        raise AssertionError("rotations computed again although cached")
    monkeypatch.setattr(rotation_mod, "calibrate_rotations", fail)
    other = cache.load_or_calibrate(model, source, 0.4, "teal", "none", "uniform",
                                    rotation="pca")          # another S: the same axes
    assert torch.equal(other.rotations["gate_up"][0], first.rotations["gate_up"][0])
    # rotated thresholds of coordinates computed another way (before int8 x) are not used
    import json
    path = next((tmp_path / "sparsity").rglob("teal-uniform-pca-S0.500.json"))
    saved = json.loads(path.read_text())
    assert saved["calibration"]["coordinates"] == rotation_mod.ROTATED_COORDINATES
    del saved["calibration"]["coordinates"]
    path.write_text(json.dumps(saved))
    assert cache.load_thresholds(first.calibration["model"], "teal", 0.5, "uniform",
                                 "pca") is None
    # thresholds whose axes are gone are not used: calibrated again (and fail here)
    next((tmp_path / "sparsity").rglob("rotations-pca.safetensors")).unlink()
    assert cache.load_thresholds(first.calibration["model"], "teal", 0.5, "uniform",
                                 "pca") is None
    with pytest.raises(AssertionError, match="computed again"):
        cache.load_or_calibrate(model, source, 0.5, "teal", "none", "uniform", rotation="pca")


def test_rotation_left_out_where_it_cannot_pay(tiny_model_factory):
    """A level whose skipped rows cannot repay the d x d rotation keeps the input as it is."""
    from kvforge.sparsity.calibrate import rotation_pays
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir)
    model = llm.engine.runner.model
    gate_up = model.model.layers[0].mlp.gate_up_proj
    low = 0.5 * gate_up.input_size / gate_up.output_size        # half the break-even level
    assert not rotation_pays(model, "gate_up", low) and rotation_pays(model, "gate_up", 0.5)
    ids = torch.randint(3, 1000, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    t = calibrate(model, ids, low, "teal", window=200, rotation="pca")
    assert t.rotations == {} and t.calibration["rotated"] == []
    assert calibrate(model, ids, 0.5, "teal", window=200, rotation="pca").calibration[
        "rotated"] == ["gate_up"]
