"""Run-time kernel choice for fp32 projections (kernels/tune.py, csrc/linear_plan.cpp): every
plan the tuner can pick computes x @ W^T (on each ISA this CPU runs), installed plans steer the
kernels, the cache is keyed and reused, KVFORGE_TUNE=0 skips tuning, and greedy tokens do not
depend on the plan."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

import kvforge.kernels as kernels
from kvforge.kernels import isa, ops, tune

RUNNABLE = [name for name in ("avx2", "avx512") if name in isa.supported_isas()]


def _module(name):
    if name not in RUNNABLE:
        pytest.skip(f"this CPU cannot run {name} code")
    module = kernels.cpu_kernels(name)
    if module is None:
        pytest.skip("no compiled kernels")
    return module


@pytest.fixture(autouse=True)
def no_installed_plans():
    """Plans are process-wide: every test starts and ends without any."""
    tune.install([])
    yield
    tune.install([])


@pytest.fixture
def kernel_module():
    module = kernels.cpu_kernels()
    if module is None:
        pytest.skip("no compiled kernels")
    return module


def _xw(rows, in_features, out_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, in_features, generator=g),
            torch.randn(out_features, in_features, generator=g) * 0.1)


@pytest.mark.parametrize("name", ["avx2", "avx512"])
@pytest.mark.parametrize("rows,in_features,out_features", [(1, 64, 37), (3, 72, 50),
                                                           (8, 520, 29), (33, 136, 61)])
def test_every_tile_blocking_and_prefetch_matches_the_reference(name, rows, in_features,
                                                                out_features):
    """Every tile of the table (1..8 x 1..8) with and without row / K blocking and at every
    prefetch distance: x @ W^T to float rounding. Tile, row blocks and prefetch leave each
    output's arithmetic alone, so those agree bit for bit with the default plan."""
    module = _module(name)
    x, w = _xw(rows, in_features, out_features)
    reference = F.linear(x, w)
    default = module.linear_with_plan(x, w, -1, 0, 0)
    torch.testing.assert_close(default, reference, rtol=1e-5, atol=1e-5)
    for m in range(1, 9):
        for n in range(1, 9):
            for block_m, prefetch in ((0, -1), (2, 0), (5, 4), (0, 1)):
                y = module.linear_with_plan(x, w, -1, m, n, 0, block_m, prefetch)
                assert torch.equal(y, default), (m, n, block_m, prefetch)
            y = module.linear_with_plan(x, w, -1, m, n, 16 * (m % 3 + 1), 3, 2)   # K split
            torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["avx2", "avx512"])
def test_packed_plans_match_the_reference(name):
    """Every tile, K split and row block of the packed kernel, on this ISA's layout
    [groups, K / lanes, R, lanes] (ops.py; panels: lanes = 1), ragged groups; 300 rows: panels
    past their K-split range take x in row blocks."""
    module = _module(name)
    group, lanes = int(module.linear_pack_rows), int(module.linear_pack_lanes)
    k = 4 * int(module.linear_lanes)
    for rows in (1, 2, 5, 9, 300):
        x, w = _xw(rows, k, 21, seed=rows)
        groups = -(-21 // group)
        padded = F.pad(w, (0, 0, 0, groups * group - 21))
        packed = padded.view(groups, group, k // lanes, lanes).permute(0, 2, 1, 3).contiguous()
        for m in range(int(module.linear_plan(k, 21, 64, True)[0]) + 1):
            for n in (0, 2, 8):
                if (m == 0) != (n == 0):
                    continue
                for block_k, block_m in ((0, 0), (lanes, 0), (max(lanes, 8), 3)):
                    y = module.linear_with_plan(x, packed, 21, m, n, block_k, block_m)
                    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
        # a row-major plan's 8-row tile (the plans are keyed by shape only): clamped to the
        # widest panel tile, same product
        widest = int(module.linear_plan(k, 21, 64, True)[0])
        assert module.linear_plan(k, 21, rows, True)[0] <= widest
        y = module.linear_with_plan(x, packed, 21, 8, 8)
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_every_candidate_the_tuner_tries_is_correct(kernel_module):
    """The candidate lists of every row point, as Plan.run executes them, against F.linear."""
    x_all, w = _xw(256, 96, 45)
    for rows in tune.row_points(256, int(kernel_module.linear_few_rows_max)):
        x = x_all[:rows]
        tiles = tune.tile_candidates(kernel_module, rows, False)
        assert tiles[0] == tuple(kernel_module.linear_plan(96, 45, rows, False)[:2])
        regs = int(kernel_module.linear_registers)
        for m, n in tiles:
            assert m * n + m + 1 <= regs + 1, (m, n)
            for plan in (tune.Plan("tiled", m, n), tune.Plan("tiled", m, n, block_m=m),
                         tune.Plan("tiled", m, n, block_k=32), tune.Plan("tiled", m, n,
                                                                         prefetch_tiles=0)):
                torch.testing.assert_close(plan.run(kernel_module, x, w, -1), F.linear(x, w),
                                           rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tune.Plan("mkl").run(kernel_module, x, w, -1),
                                   F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_wrong_candidates_are_dropped(kernel_module, monkeypatch):
    """A candidate whose product is wrong never wins, however fast."""
    bad = tune.Plan("tiled", 2, 2)
    real_run = tune.Plan.run

    def run(self, module, x, weight, packed_out):
        y = real_run(self, module, x, weight, packed_out)
        return y + 1.0 if self == bad else y

    monkeypatch.setattr(tune.Plan, "run", run)
    monkeypatch.setattr(tune, "tile_candidates", lambda *a: [(3, 4), (2, 2)])
    w = torch.randn(40, 64)
    choice = tune.tune_point(kernel_module, 16, tune._Rotation(w), -1, w)
    assert choice.plan != bad


def test_installed_plans_steer_the_kernels(kernel_module):
    lanes = int(kernel_module.linear_lanes)
    k = 8 * lanes
    shape = tune.ShapeTuning(k, 40, False, [
        tune.PointChoice(2, tune.Plan("tiled", 2, 5, prefetch_tiles=0), 1.0, 2.0, 1.0),
        tune.PointChoice(16, tune.Plan("mkl"), 1.0, 1.0, 2.0),
        tune.PointChoice(64, tune.Plan("tiled", 4, 3, block_m=8), 1.0, 2.0, 1.0)])
    tune.install([shape])
    assert kernel_module.linear_plan(k, 40, 2, False)[:2] == (2, 5)
    assert kernel_module.linear_plan(k, 40, 2, False)[4] == 0
    assert kernel_module.linear_plan(k, 40, 9, False)[5] is True          # MKL
    assert kernel_module.linear_plan(k, 40, 64, False)[:2] == (4, 3)
    assert kernel_module.linear_plan(k, 40, 64, False)[3] == 8
    assert kernel_module.linear_plan(k, 40, 65, False)[5] is True         # past the last point
    assert kernel_module.linear_plan(k, 41, 64, False)[5] is False        # another shape
    w = torch.randn(40, k)
    for rows, kernel in ((1, True), (9, False), (40, True), (300, False)):
        assert tune.tuned_kernel_rows(k, 40, rows) is kernel
        x = torch.randn(rows, k)
        y = ops.linear_rows(x, w)
        assert (y is not None) is kernel
        if y is not None:
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert tune.tuned_kernel_rows(k, 41, 1) is None
    tune.install([])
    assert kernel_module.linear_plan(k, 40, 9, False)[5] is False
    assert ops.linear_rows(torch.randn(9, k), w) is not None


def test_bad_plans_are_refused(kernel_module):
    with pytest.raises(ValueError, match="kind"):
        tune.Plan("fast")
    with pytest.raises(ValueError, match="outside"):
        tune.Plan("tiled", 9, 1)
    with pytest.raises(RuntimeError, match="outside 1..8"):
        kernel_module.set_linear_plans([[64, 64, 4, 9, 1, 0, 0, -1, 0]])
    with pytest.raises(RuntimeError, match="ascend"):
        kernel_module.set_linear_plans([[64, 64, 8, 1, 1, 0, 0, -1, 0],
                                        [64, 64, 4, 1, 1, 0, 0, -1, 0]])
    with pytest.raises(RuntimeError, match="outside 1..8"):
        kernel_module.linear_with_plan(torch.randn(2, 64), torch.randn(8, 64), -1, 0, 12)


def test_row_points():
    assert tune.row_points(256, 4) == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    assert tune.row_points(100, 8) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 100]
    assert tune.row_points(3, 4) == [1, 2, 3]
    assert tune.row_points(4096, 4)[-1] == tune.MAX_TUNED_ROWS
    with pytest.raises(ValueError, match="max_rows"):
        tune.row_points(0, 4)


def test_cache_is_reused_and_forced_again(kernel_module, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(tune.ENV_VAR, "1")
    calls = []
    progress = lambda done, total, what: calls.append((done, total))   # noqa: E731
    shapes = [(64, 48, False, 8), (128, 48, False, 3)]
    first = tune.tune_linear_shapes(shapes, progress=progress)
    assert [t.key for t in first] == ["48x64", "48x128"]
    # one point per row up to the build's register tile (4 rows AVX2, more AVX-512), then 8
    assert [c.rows_max for c in first[0].points] == tune.row_points(
        8, int(kernel_module.linear_few_rows_max))
    few = int(kernel_module.linear_few_rows_max)
    total = len(tune.row_points(8, few)) + len(tune.row_points(3, few))
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert tune.tuned_kernel_rows(64, 48, 9) is False          # installed: MKL past 8 rows
    path = tune.cache_path()
    assert path.parent == tmp_path / "tune"
    saved = json.loads(path.read_text())
    assert saved["machine"]["isa"] == isa.selected_isa()
    assert saved["machine"]["threads"] == torch.get_num_threads()
    assert set(saved["shapes"]) == {"48x64", "48x128"}
    calls.clear()
    again = tune.tune_linear_shapes(shapes, progress=progress)
    assert calls == [] and [t.points for t in again] == [t.points for t in first]
    more = tune.tune_linear_shapes([(64, 48, False, 16)], progress=progress)   # more rows
    assert calls and [c.rows_max for c in more[0].points][-1] == 16
    calls.clear()
    tune.tune_linear_shapes(shapes, force=True, progress=progress)
    assert calls
    path.write_text("{not json")
    assert tune.load_cache(path) == {}


def test_env_var_skips_tuning(kernel_module, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(tune.ENV_VAR, "0")
    assert tune.tune_linear_shapes([(64, 48, False, 8)], progress=None) == []
    assert tune.installed() == {}
    assert not (tmp_path / "tune").exists()
    monkeypatch.setenv(tune.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="sometimes"):
        tune.tune_linear_shapes([(64, 48, False, 8)], progress=None)


def test_cache_key_changes_with_threads(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    assert tune.cache_path(1) != tune.cache_path(2)


def _plans_to_try(module) -> list[tune.Plan]:
    """Every plan the tuner could install for the tiny model's shapes (any row point)."""
    plans = [tune.Plan("mkl")]
    for rows in tune.row_points(256, int(module.linear_few_rows_max)):
        for m, n in tune.tile_candidates(module, rows, False):
            plans += [tune.Plan("tiled", m, n), tune.Plan("tiled", m, n, block_m=m),
                      tune.Plan("tiled", m, n, block_k=32), tune.Plan("tiled", m, n,
                                                                      prefetch_tiles=4)]
    return list(dict.fromkeys(plans))


def test_greedy_tokens_do_not_depend_on_the_plan(kernel_module, tiny_model_factory, monkeypatch):
    """Whatever plan the tuner installs for every projection and row count (tiles, blocking,
    prefetch, MKL), a batch of greedy requests (prefill chunks through the Python layers,
    decode steps through the compiled stack) gives the tokens of the untuned engine."""
    from kvforge import LLM, SamplingParams
    monkeypatch.setenv(tune.ENV_VAR, "0")
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    llm = LLM(path, block_size=4, num_kv_blocks=128, enable_prefix_caching=False,
              quantization="none")
    prompts = [[5, 77, 901, 13, 4000, 7][: 2 + i] * (i + 1) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = tokens()
    shapes = tune.model_linear_shapes(llm.engine.runner.model, 256, 8)
    assert shapes, "the tiny model has fp32 projections to tune"
    for plan in _plans_to_try(kernel_module):
        tune.install([tune.ShapeTuning(i, o, p, [tune.PointChoice(256, plan, 1.0, 1.0, 1.0)])
                      for i, o, p, _ in shapes])
        assert tokens() == expected, plan.label()


def test_tune_command(kernel_module, tiny_model_factory, tmp_path, monkeypatch, capsys):
    """``kvforge tune MODEL`` tunes the model's projection shapes again and prints the choice
    per row range; bad limits are clear errors."""
    from kvforge.cli import main
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(tune.ENV_VAR, "0")          # the command tunes regardless (forced)
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    assert main(["tune", path, "--max-num-seqs", "2", "--max-num-batched-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "vector registers" in out and "L1d" in out
    # the head (a "p" where the build packs its weights)
    assert re.search(r"49152x64p?: 1: tile", out) and "2: tile" in out and ">2: MKL" in out
    assert "128x64" in out or "256x64" in out                                      # gate|up
    assert tune.cache_path().exists()
    assert main(["tune", path, "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be >= 1, got 0" in capsys.readouterr().err


def test_tune_command_times_a_gguf_files_block_types_again(kernel_module, default_model_path,
                                                           tmp_path, monkeypatch, capsys):
    """For a GGUF model ``kvforge tune`` also re-times the many-row crossover of each block
    type the file holds and its many-row kernel (kernels/gguf_tiles.py), caches them, and
    prints them."""
    import json

    from kvforge.cli import main
    from kvforge.kernels import gguf_tiles
    from kvforge.loader.source import load_model_source
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(gguf_tiles.ENV_VAR, raising=False)
    types = {t.tensor_type.name for t in load_model_source(default_model_path).gguf_reader().tensors}
    block_types = sorted(types & set(gguf_tiles.BLOCK_TYPES))
    assert "Q4_1" in block_types
    assert main(["tune", default_model_path, "--max-num-seqs", "1",
                 "--max-num-batched-tokens", "2"]) == 0
    out = capsys.readouterr().out
    printed = dict(re.findall(r"^GGUF (\w+): (.*)$", out, re.M))
    assert sorted(printed) == block_types
    stored = {json.loads(p.read_text())["type"]: json.loads(p.read_text())
              for p in (tmp_path / "tune").glob("gguf-gemm-rows-*.json")}
    assert sorted(stored) == block_types
    names = {"panels": "int8 panels", "tiles": "fp32 tiles + GEMM"}
    for name, entry in stored.items():
        rows, kernel = entry["gemm_min_rows"], entry["kernel"]
        assert rows in (0, *gguf_tiles.CANDIDATE_ROWS)
        assert kernel in gguf_tiles.KERNELS
        assert printed[name] == (f"{names[kernel]} from {rows} rows" if rows
                                 else "integer kernels at every row count")
