"""Long prefill chunks on fp32 tiles (GgufWeight gemm_min_rows) and the per-machine choice of
where they start (kernels/gguf_tiles.py)."""
from __future__ import annotations

import json

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvforge.kernels import gguf_tiles
from tests.kernels.test_cpu_kernels import compiled, needs_kernels  # noqa: F401 (fixture)
from tests.kernels.test_gguf_kernels import random_blocks, reference_weight


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_tiles_from_gemm_min_rows_on_and_integers_below(compiled, qtype):
    n, k = 40, 512
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=5))
    ref_w = torch.from_numpy(reference_weight(raw.numpy(), qtype))
    integer = compiled.GgufWeight([raw], [int(qtype)], k)                  # default: never
    tiled = compiled.GgufWeight([raw], [int(qtype)], k, gemm_min_rows=100)
    x = torch.randn(120, k, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ ref_w.T
    magnitude = (x.double().abs() @ ref_w.abs().T).max()
    y_tiles, y_int = tiled.linear(x), integer.linear(x)
    # tiles: fp32 products of the dequantized weights (no activation rounding)
    assert (y_tiles.double() - exact).abs().max() <= 1e-5 * magnitude
    # integers: 8-bit activations, visibly coarser than fp32 on random data
    assert (y_int.double() - exact).abs().max() > 1e-4 * magnitude
    # below the threshold the tiled weight runs the same integer kernels as the default
    assert torch.equal(tiled.linear(x[:99]), y_int[:99])
    with pytest.raises(RuntimeError, match="gemm_min_rows"):
        compiled.GgufWeight([raw], [int(qtype)], k, gemm_min_rows=-1)


def test_env_sets_the_rows_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "384")
    assert gguf_tiles.gemm_min_rows() == 384
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "0")
    assert gguf_tiles.gemm_min_rows() == 0
    for bad in ("-3", "many"):
        monkeypatch.setenv(gguf_tiles.ENV_VAR, bad)
        with pytest.raises(ValueError, match=bad):
            gguf_tiles.gemm_min_rows()
    monkeypatch.delenv(gguf_tiles.ENV_VAR)
    monkeypatch.setenv("KVFORGE_TUNE", "0")                # the suite's setting: integers only
    assert gguf_tiles.gemm_min_rows() == 0


@needs_kernels
def test_measured_choice_is_one_of_the_candidates_and_cached(compiled, monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(gguf_tiles.ENV_VAR, raising=False)
    monkeypatch.setenv("KVFORGE_TUNE", "1")
    gguf_tiles._measured.cache_clear()
    try:
        rows = gguf_tiles.gemm_min_rows()
        assert rows in (0, *gguf_tiles.CANDIDATE_ROWS)
        (cached,) = (tmp_path / "tune").glob("gguf-gemm-rows-*.json")
        assert json.loads(cached.read_text())["gemm_min_rows"] == rows
        # a later process reads the file instead of timing again
        cached.write_text(json.dumps({"gemm_min_rows": 512}))
        gguf_tiles._measured.cache_clear()
        assert gguf_tiles.gemm_min_rows() == 512
    finally:
        gguf_tiles._measured.cache_clear()


def test_synthetic_weight_has_finite_scales():
    raw = gguf_tiles.synthetic_q4_k(4, 512)
    assert raw.shape == (4, 2 * 144)
    blocks = raw.numpy().reshape(4, 2, 144)
    scales = blocks[:, :, :4].copy().view("float16")
    assert (scales[..., 0] == torch.tensor(0.01).half().item()).all()
    assert torch.isfinite(torch.from_numpy(scales.astype("float32"))).all()
