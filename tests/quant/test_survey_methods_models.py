"""zeroquant, fp4, spqr and LoRC on tiny random Llamas: ``kvforge quantize`` saves them and a
reload gives the same parameters, logits and greedy tokens without requantizing or
recalibrating; logits stay within bounds of fp32 set by each format's own error."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM
from kvforge.cli import main
from kvforge.layers.linear import Linear, PackedLinearMethod, UnquantizedLinearMethod
from kvforge.loader.source import load_model_source
from kvforge.quant.calibration import CalibratedQuantConfig
from kvforge.quant.loading import load_model
from kvforge.quant.lowrank import LoRCConfigMixin
from kvforge.quant.serialize import read_saved_quantization
from tests.quant.test_weight_only_models import PROMPTS, _greedy, _logits

# method -> (quantization args, bound on |fake-quantized logits - fp32| / |fp32|): the weight
# format's own error on this tiny model, whose logits amplify it (int4 g32 RTN is ~0.2 here)
METHODS = {
    "zeroquant": ({"group_size": 32}, 0.03),
    "zeroquant-lkd": ({"group_size": 32, "lkd_steps": 3, "lkd_samples": 64}, 0.03),
    "fp4": ({"group_size": 32, "asymmetric": 1}, 0.3),
    "fp4-act": ({"group_size": 32, "asymmetric": 1, "formats": "mixed", "scale_search": 4,
                 "act_aware": 1}, 0.3),
    "spqr": ({"bits": 3, "group_size": 16, "outlier_fraction": 0.01}, 0.4),
    "int4-lorc": ({"group_size": 32, "lorc_rank": 4, "lorc_act": 1}, 0.25),
    "zeroquant-lorc": ({"group_size": 0, "lorc_rank": 4}, 0.03),
}


def fake_quantized(model, source):
    """The fp32 model with every quantized layer's weight replaced by what its codes stand for
    (``method.dequantize``): the error of the weight format alone."""
    fake = load_model(source)
    modules = dict(fake.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            # packed layers hold fp32 weights (AVX-512 builds pack them for the decode kernels)
            if isinstance(module, Linear) and type(module.method) not in (
                    UnquantizedLinearMethod, PackedLinearMethod):
                modules[name].weight.copy_(module.method.dequantize(module))
    return fake


def _name(method: str) -> str:
    return method.split("-")[0]


def _no_requantization(monkeypatch):
    """A reload must install the saved codes: calibration and LoRC's SVD are refused."""
    def refuse(*args, **kwargs):
        raise AssertionError("a saved model was quantized again")
    monkeypatch.setattr(CalibratedQuantConfig, "calibrate", refuse)
    monkeypatch.setattr(LoRCConfigMixin, "calibrate", refuse)
    monkeypatch.setattr("kvforge.quant.calibration.calibrate_recording_layers", refuse)
    monkeypatch.setattr("kvforge.quant.lowrank.low_rank_factors", refuse)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_quantize_cli_then_reload_is_identical_and_close_to_fp32(
        method, tiny_model_factory, tmp_path, monkeypatch, capsys):
    hf_dir, _ = tiny_model_factory("llama", initializer_range=0.1)
    name, (args, bound) = _name(method), METHODS[method]
    out = str(tmp_path / method)
    cli = ["quantize", hf_dir, "--quantization", name, "--out", out]
    for k, v in args.items():
        cli += ["--quantization-arg", f"{k}={v}"]
    assert main(cli) == 0
    assert f"saved {name} model" in capsys.readouterr().out
    saved_name, saved_args = read_saved_quantization(out)
    assert saved_name == name and all(saved_args[k] == v for k, v in args.items())

    source = load_model_source(hf_dir)
    fresh = load_model(source, quantization=name, quantization_args=args)
    quantized = [m for m in fresh.modules() if isinstance(m, Linear)
                 and type(m.method) is not UnquantizedLinearMethod]
    assert len(quantized) >= 4 * fresh.num_layers
    _no_requantization(monkeypatch)
    reloaded = load_model(load_model_source(out))
    assert reloaded.quant_config.name == name
    a, b = dict(fresh.named_parameters()), dict(reloaded.named_parameters())
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    ids = PROMPTS[1]
    ours = _logits(fresh, ids)
    assert torch.equal(ours, _logits(reloaded, ids))
    ref, fake = _logits(load_model(source), ids), _logits(fake_quantized(fresh, source), ids)
    format_err = float((fake - ref).norm() / ref.norm())
    assert 0 < format_err < bound, format_err
    # the kernels compute what the codes say, up to their activation rounding (bf16 / int8)
    assert float((ours - fake).norm() / ref.norm()) < 0.02

    kw = dict(kv_cache_memory="8MiB")
    reloaded_tokens = _greedy(LLM(out, **kw))
    monkeypatch.undo()
    assert reloaded_tokens == _greedy(LLM(hf_dir, quantization=name, quantization_args=args,
                                          **kw))


@pytest.mark.parametrize("name,args", [("int4", {"group_size": 32}), ("fp4", {"group_size": 32}),
                                       ("zeroquant", {"group_size": 0}),
                                       ("int4", {"group_size": 32, "lorc_act": 1})])
def test_lorc_reduces_the_models_logit_error(tiny_model_factory, name, args):
    hf_dir, _ = tiny_model_factory("llama", initializer_range=0.1)
    source = load_model_source(hf_dir)
    ids = PROMPTS[1]
    ref = _logits(load_model(source), ids)

    def err(rank):
        model = load_model(source, quantization=name,
                           quantization_args={**args, "lorc_rank": rank})
        return float((_logits(model, ids) - ref).norm())

    plain, lorc = err(0), err(8)
    assert lorc < 0.9 * plain, (plain, lorc)
