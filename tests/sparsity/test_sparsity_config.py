"""Options, calibration and the threshold cache of activation sparsity (kvforge/sparsity)."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.sparsity.calibrate import calibrate, weight_shares
from kvforge.sparsity.masking import SparsityMasks
from kvforge.sparsity.thresholds import SparsityThresholds


@pytest.mark.parametrize("kwargs,message", [
    ({"activation_sparsity": 1.0}, r"in \[0, 1\) \(0 = off\), got 1.0"),
    ({"activation_sparsity": -0.1}, r"got -0.1"),
    ({"activation_sparsity": "half"}, r"must be a number in \[0, 1\), got 'half'"),
    ({"activation_sparsity": True}, r"got True"),
    ({"activation_sparsity": 0.5, "activation_sparsity_mode": "relu"}, r"teal, cats, got 'relu'"),
    ({"activation_sparsity_allocation": "best"}, r"greedy, uniform, got 'best'"),
    ({"activation_sparsity": 0.5, "tensor_parallel_size": 2}, r"tensor_parallel_size must be 1"),
    ({"activation_sparsity": 0.5, "offload_memory_budget": "512MiB"},
     r"offloaded models \(offload_memory_budget '512MiB'\) stream dense layers"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_config_defaults_off_and_cli_flags():
    from kvforge.cli import add_engine_args, engine_kwargs
    import argparse
    assert EngineConfig().activation_sparsity == 0.0
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--activation-sparsity", "0.4", "--activation-sparsity-mode", "cats",
                         "--activation-sparsity-allocation", "uniform"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert (cfg.activation_sparsity, cfg.activation_sparsity_mode,
            cfg.activation_sparsity_allocation) == (0.4, "cats", "uniform")
    with pytest.raises(SystemExit):
        p.parse_args(["--activation-sparsity-mode", "relu"])


def test_thresholds_validate_and_round_trip():
    t = SparsityThresholds("cats", 0.5, {"gate": [0.1, 0.2]}, {"tokens": 3})
    assert SparsityThresholds.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="cats thresholds need kinds"):
        SparsityThresholds("cats", 0.5, {"qkv": [0.1]})
    with pytest.raises(ValueError, match="one threshold per layer"):
        SparsityThresholds("teal", 0.5, {"qkv": [0.1], "o": [0.1, 0.2], "gate_up": [0.1],
                                         "down": [0.1]})


def _tiny(tiny_model_factory):
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    hf_dir, _ = tiny_model_factory("llama")
    source = load_model_source(hf_dir)
    return source, load_model(source, quantization="none")


def _ids(n=800, seed=0):
    return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", ["teal", "cats"])
@pytest.mark.parametrize("sparsity", [0.25, 0.5])
def test_calibrated_thresholds_reach_the_target(tiny_model_factory, mode, sparsity):
    """On the calibration text every thresholded input loses ~S of its entries, and more S
    gives larger thresholds."""
    from kvforge.eval.perplexity import window_nll
    _, model = _tiny(tiny_model_factory)
    ids = _ids()
    t = calibrate(model, ids, sparsity, mode, window=200)
    assert t.calibration["levels"] == {k: sparsity for k in t.layers}
    with SparsityMasks(model, t) as masks, torch.inference_mode():
        for s in range(0, len(ids), 200):
            window_nll(model, ids[s:s + 200])
    for kind, fraction in masks.realised().items():
        if ":block" in kind:        # whole 32-input blocks: a different count
            continue
        assert abs(fraction - sparsity) < 0.03, (kind, fraction)
    lower = calibrate(model, ids, sparsity / 2, mode, window=200)
    for kind in t.layers:
        assert all(a < b for a, b in zip(lower.layers[kind], t.layers[kind]))


def test_greedy_allocation_meets_the_weight_target(tiny_model_factory):
    _, model = _tiny(tiny_model_factory)
    t = calibrate(model, _ids(400), 0.4, "teal", allocation="greedy", window=200)
    levels, shares = t.calibration["levels"], weight_shares(model)
    assert t.calibration["allocation"] == "greedy"
    assert sum(shares[k] * levels[k] for k in levels) == pytest.approx(0.4, abs=1e-6)
    assert len(set(levels.values())) > 1          # a per-kind allocation, not uniform


def test_thresholds_cached_per_model_and_target(tiny_model_factory, tmp_path, monkeypatch):
    import kvforge.sparsity.calibrate as calibrate_mod
    from kvforge.sparsity import cache
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_mod, "calibration_tokens", lambda tok: _ids(400))
    source, model = _tiny(tiny_model_factory)
    first = cache.load_or_calibrate(model, source, 0.5, "teal", "none", "uniform")
    files = list((tmp_path / "sparsity").rglob("*.json"))
    assert [f.name for f in files] == ["teal-uniform-S0.500.json"]

    def fail(*a, **k):
        raise AssertionError("calibrated again although cached")
    monkeypatch.setattr(calibrate_mod, "calibrate", fail)
    assert cache.load_or_calibrate(model, source, 0.5, "teal", "none", "uniform") == first
    with pytest.raises(AssertionError, match="calibrated again"):      # another S: a new file
        cache.load_or_calibrate(model, source, 0.25, "teal", "none", "uniform")


def test_engine_zero_sparsity_is_todays_output(tiny_model_factory):
    from kvforge.engine.llm import LLM
    from tests.kernels.test_cpu_kernels import _greedy
    hf_dir, _ = tiny_model_factory("llama")
    prompts = [[5, 17, 300, 42, 9], list(range(100, 130))]
    today = _greedy(LLM(hf_dir, num_kv_blocks=64, block_size=4), prompts, max_tokens=10)
    zero = LLM(hf_dir, num_kv_blocks=64, block_size=4, activation_sparsity=0.0)
    assert _greedy(zero, prompts, max_tokens=10) == today


def test_engine_option_calibrates_and_decodes_sparse(tiny_model_factory, tmp_path, monkeypatch):
    import kvforge.sparsity.calibrate as calibrate_mod
    from kvforge.engine.llm import LLM
    from tests.kernels.test_cpu_kernels import _greedy
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_mod, "calibration_tokens", lambda tok: _ids(400))
    hf_dir, _ = tiny_model_factory("llama")
    prompts = [[5, 17, 300, 42, 9], list(range(100, 130))]
    dense = _greedy(LLM(hf_dir, num_kv_blocks=64, block_size=4), prompts, max_tokens=10)[0]
    sparse = LLM(hf_dir, num_kv_blocks=64, block_size=4, activation_sparsity=0.6,
                 activation_sparsity_allocation="uniform")
    assert list((tmp_path / "sparsity").rglob("teal-uniform-S0.600.json"))
    assert _greedy(sparse, prompts, max_tokens=10)[0] != dense


def test_gguf_blocks_decode_dense_without_calibrating(default_model_path, monkeypatch, caplog):
    """The native GGUF path has no projection the sparse kernels read: the engine says so at
    start instead of calibrating thresholds (a minute of fp32 prefills) nothing would use."""
    import logging
    import kvforge.sparsity.engine as engine_mod
    from kvforge.engine.llm import LLM

    def fail(*a, **k):
        raise AssertionError("calibrated for a model that decodes dense")
    monkeypatch.setattr(engine_mod, "load_or_calibrate", fail)
    with caplog.at_level(logging.WARNING, logger="kvforge.sparsity.engine"):
        llm = LLM(default_model_path, num_kv_blocks=64, block_size=16, activation_sparsity=0.25)
    assert "GGUF blocks decode dense" in caplog.text
    from tests.kernels.test_cpu_kernels import _greedy
    prompts = [[5, 17, 300, 42, 9]]
    dense = LLM(default_model_path, num_kv_blocks=64, block_size=16)
    assert _greedy(llm, prompts, max_tokens=8) == _greedy(dense, prompts, max_tokens=8)
