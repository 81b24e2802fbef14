"""Long prefill chunks on fp32 tiles (GgufWeight gemm_min_rows) and the per-machine choice of
where they start (kernels/gguf_tiles.py)."""
from __future__ import annotations

import json

import numpy as np

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


def test_env_sets_the_rows_per_type_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "384")
    assert gguf_tiles.gemm_min_rows("Q4_K") == gguf_tiles.gemm_min_rows("Q4_1") == 384
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "0")
    assert gguf_tiles.gemm_min_rows("Q4_K") == 0
    # per type, a bare number for the types not named
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "q4_1=48, Q6_K=0, 512")
    assert gguf_tiles.gemm_min_rows("Q4_1") == 48
    assert gguf_tiles.gemm_min_rows("Q6_K") == 0
    assert gguf_tiles.gemm_min_rows("Q4_K") == 512
    for bad in ("-3", "many", "Q4_1=-1", "Q4_1=x", "IQ2_XS=64", "F16=64"):
        monkeypatch.setenv(gguf_tiles.ENV_VAR, bad)
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            gguf_tiles.gemm_min_rows("Q4_K")
    with pytest.raises(ValueError, match="F32"):
        gguf_tiles.gemm_min_rows("F32")
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "Q4_1=48")
    monkeypatch.setenv("KVFORGE_TUNE", "0")                # the suite's setting: integers only
    assert gguf_tiles.gemm_min_rows("Q4_K") == 0           # unset types: not measured
    assert gguf_tiles.gemm_min_rows("Q4_1") == 48
    monkeypatch.delenv(gguf_tiles.ENV_VAR)
    assert gguf_tiles.gemm_min_rows("Q4_1") == 0


def test_a_projection_takes_the_crossover_of_its_largest_block_type(monkeypatch):
    monkeypatch.setenv(gguf_tiles.ENV_VAR, "Q4_K=256,Q6_K=512,Q4_1=48")
    monkeypatch.delenv(gguf_tiles.KERNEL_ENV_VAR, raising=False)
    monkeypatch.setenv("KVFORGE_TUNE", "0")
    # a Q4_K_M qkv: q and k Q4_K, v Q6_K
    assert gguf_tiles.shard_gemm_path(["Q4_K", "Q4_K", "Q6_K"], [1536, 256, 256])[0] == 256
    assert gguf_tiles.shard_gemm_path(["Q4_K", "Q6_K"], [256, 1536])[0] == 512
    # float shards do not vote; all-float projections never take these tiles
    assert gguf_tiles.shard_gemm_path(["F32", "Q4_1"], [4096, 8])[0] == 48
    assert gguf_tiles.shard_gemm_path(["F16"], [4096])[0] == 0
    # what a tensor-parallel worker gets: the same numbers and kernels, named
    monkeypatch.setenv(gguf_tiles.KERNEL_ENV_VAR, "Q6_K=tiles")
    assert gguf_tiles.shared_env(["Q6_K", "F32", "Q4_K", "Q4_K"]) == {
        gguf_tiles.ENV_VAR: "Q4_K=256,Q6_K=512",
        gguf_tiles.KERNEL_ENV_VAR: "Q4_K=panels,Q6_K=tiles"}
    assert gguf_tiles.shared_env(["F32"]) == {gguf_tiles.ENV_VAR: "0",
                                              gguf_tiles.KERNEL_ENV_VAR: "tiles"}
    # the voting type's kernel decides for the whole projection
    assert gguf_tiles.shard_gemm_path(["Q4_K", "Q4_K", "Q6_K"], [1536, 256, 256]) == (256, True)
    assert gguf_tiles.shard_gemm_path(["Q4_K", "Q6_K"], [256, 1536]) == (512, False)
    assert gguf_tiles.shard_gemm_path(["F16"], [4096]) == (0, False)


def test_env_sets_the_kernel_per_type_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv(gguf_tiles.KERNEL_ENV_VAR, raising=False)
    monkeypatch.setenv("KVFORGE_TUNE", "0")
    # not measured: panels wherever a type has a panel form; Q8_0 has none
    assert gguf_tiles.gemm_kernel("Q4_K") == gguf_tiles.gemm_kernel("Q6_K") == "panels"
    assert gguf_tiles.gemm_kernel("Q8_0") == "tiles"
    monkeypatch.setenv(gguf_tiles.KERNEL_ENV_VAR, "tiles")
    assert gguf_tiles.gemm_kernel("Q4_K") == "tiles"
    monkeypatch.setenv(gguf_tiles.KERNEL_ENV_VAR, "q6_k=Tiles, panels")
    assert gguf_tiles.gemm_kernel("Q6_K") == "tiles"
    assert gguf_tiles.gemm_kernel("Q4_1") == "panels"
    monkeypatch.setenv(gguf_tiles.KERNEL_ENV_VAR, "Q8_0=panels")
    assert gguf_tiles.gemm_kernel("Q8_0") == "tiles"            # no panel form: not offered
    for bad in ("fast", "Q4_K=gemm", "IQ2_XS=tiles"):
        monkeypatch.setenv(gguf_tiles.KERNEL_ENV_VAR, bad)
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            gguf_tiles.gemm_kernel("Q4_K")


@needs_kernels
def test_measured_choice_is_one_of_the_candidates_and_cached_per_type(compiled, monkeypatch,
                                                                      tmp_path):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(gguf_tiles.ENV_VAR, raising=False)
    monkeypatch.delenv(gguf_tiles.KERNEL_ENV_VAR, raising=False)
    monkeypatch.setenv("KVFORGE_TUNE", "1")
    gguf_tiles._measured.cache_clear()
    try:
        rows = {t: gguf_tiles.gemm_min_rows(t) for t in ("Q4_1", "Q4_K")}
        for t, r in rows.items():
            assert r in (0, *gguf_tiles.CANDIDATE_ROWS), t
        cached = {json.loads(p.read_text())["type"]: p
                  for p in (tmp_path / "tune").glob("gguf-gemm-rows-*.json")}
        assert set(cached) == {"Q4_1", "Q4_K"}
        for t, path in cached.items():
            entry = json.loads(path.read_text())
            assert entry["gemm_min_rows"] == rows[t]
            assert entry["kernel"] in gguf_tiles.KERNELS
        # a later process reads the files instead of timing again
        cached["Q4_1"].write_text(json.dumps({"gemm_min_rows": 96, "kernel": "tiles"}))
        gguf_tiles._measured.cache_clear()
        assert gguf_tiles.gemm_min_rows("Q4_1") == 96
        assert gguf_tiles.gemm_kernel("Q4_1") == "tiles"
        assert gguf_tiles.gemm_min_rows("Q4_K") == rows["Q4_K"]
    finally:
        gguf_tiles._measured.cache_clear()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_synthetic_blocks_decode_to_finite_values(qtype):
    from gguf import quants
    raw = gguf_tiles.synthetic_blocks(qtype, 4, 512, seed=3)
    values = quants.dequantize(raw, T[qtype])
    assert values.shape == (4, 512)
    assert np.isfinite(values).all() and np.abs(values).max() > 0
    # seeded: the same bytes again, other bytes for another seed
    assert (gguf_tiles.synthetic_blocks(qtype, 4, 512, seed=3) == raw).all()
    assert (gguf_tiles.synthetic_blocks(qtype, 4, 512, seed=4) != raw).any()
