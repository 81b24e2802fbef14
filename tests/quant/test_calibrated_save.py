"""Calibrated methods (AWQ, SmoothQuant) and LLM.int8() save through ``kvforge quantize`` and
reload to the same codes, logits and greedy tokens without recalibrating."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge import LLM
from kvforge.cli import main
from kvforge.loader.source import load_model_source
from kvforge.quant.calibration import CalibratedQuantConfig
from kvforge.quant.loading import load_model
from kvforge.quant.serialize import WEIGHTS_FILE, read_saved_quantization
from tests.quant.test_weight_only_models import PROMPTS, _greedy, _logits

METHODS = {"awq": {"group_size": 32}, "smoothquant": {"alpha": 0.5},
           "llm_int8": {"threshold": 6.0}}


def _no_calibration(monkeypatch):
    def refuse(self, model, batches):
        raise AssertionError("a saved model was recalibrated")
    monkeypatch.setattr(CalibratedQuantConfig, "calibrate", refuse)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_cli_quantize_then_reload_gives_identical_logits_and_greedy(
        method, tiny_model_factory, tmp_path, monkeypatch, capsys):
    hf_dir, _ = tiny_model_factory("llama")
    out = str(tmp_path / method)
    args = [f"{k}={v}" for k, v in METHODS[method].items()]
    cli = ["quantize", hf_dir, "--quantization", method, "--out", out]
    assert main(cli + sum((["--quantization-arg", a] for a in args), [])) == 0
    assert f"saved {method} model" in capsys.readouterr().out
    name, saved_args = read_saved_quantization(out)
    assert name == method and all(saved_args[k] == v for k, v in METHODS[method].items())

    fresh = load_model(load_model_source(hf_dir), quantization=method,
                       quantization_args=METHODS[method])
    _no_calibration(monkeypatch)
    reloaded = load_model(load_model_source(out))
    assert reloaded.quant_config.name == method
    fresh_params = dict(fresh.named_parameters())
    reloaded_params = dict(reloaded.named_parameters())
    assert fresh_params.keys() == reloaded_params.keys()
    for key, value in fresh_params.items():
        assert torch.equal(value, reloaded_params[key]), key
    if isinstance(fresh.quant_config, CalibratedQuantConfig):
        fresh_state = fresh.quant_config.calibration_state()
        reloaded_state = reloaded.quant_config.calibration_state()
        assert fresh_state.keys() == reloaded_state.keys() and fresh_state
        for prefix, state in fresh_state.items():
            assert torch.equal(state["scales"], reloaded_state[prefix]["scales"]), prefix
    assert torch.equal(_logits(fresh, PROMPTS[1]), _logits(reloaded, PROMPTS[1]))
    del fresh, reloaded
    kw = dict(kv_cache_memory="8MiB")
    reloaded_tokens = _greedy(LLM(out, **kw))
    monkeypatch.undo()
    assert reloaded_tokens == _greedy(LLM(hf_dir, quantization=method,
                                          quantization_args=METHODS[method], **kw))


def test_shards_saved_with_different_input_scales_are_rejected(tiny_model_factory, tmp_path):
    hf_dir, _ = tiny_model_factory("llama")
    source = load_model_source(hf_dir)
    from kvforge.quant.serialize import save_quantized
    out = save_quantized(load_model(source, quantization="awq"), source, str(tmp_path / "awq"))
    path = f"{out}/{WEIGHTS_FILE}"
    tensors = load_file(path)
    key = "model.layers.0.self_attn.k_proj.input_scales"
    tensors[key] = tensors[key] * 2
    save_file(tensors, path, metadata=_metadata(path))
    with pytest.raises(ValueError, match="different input scales"):
        load_model(load_model_source(out))


def test_saved_rows_without_input_scales_are_rejected(tiny_model_factory, tmp_path):
    hf_dir, _ = tiny_model_factory("llama")
    source = load_model_source(hf_dir)
    from kvforge.quant.serialize import save_quantized
    out = save_quantized(load_model(source, quantization="smoothquant"), source,
                         str(tmp_path / "sq"))
    path = f"{out}/{WEIGHTS_FILE}"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.down_proj.input_scales"]
    save_file(tensors, path, metadata=_metadata(path))
    with pytest.raises(ValueError, match="without their input scales"):
        load_model(load_model_source(out))


def _metadata(path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize("method", ["awq", "smoothquant"])
def test_calibration_state_requantizes_a_float_layer_identically(method):
    """``load_calibration_state`` (float weights + saved states) skips the statistics and the
    search and gives the calibrated layer's exact codes."""
    from kvforge.quant.base import get_quantization_config
    from tests.quant.factories import make_linear, outlier_activations, random_weight
    w, x = random_weight(48, 128), outlier_activations(64, 128, [3, 70])
    config = get_quantization_config(method)
    layer = make_linear(w, config.get_linear_method("x"))
    config.calibrate_layer(layer, [x])
    state = config.calibration_state()
    again = get_quantization_config(method)
    again.load_calibration_state(state)
    replay = make_linear(w, again.get_linear_method("x"))      # process_weights_after_loading
    assert replay.method.quantized
    for name, p in layer.named_parameters():
        assert torch.equal(p, dict(replay.named_parameters())[name]), name
    assert torch.equal(layer(x), replay(x))
