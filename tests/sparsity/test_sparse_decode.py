"""Sparse decode in the compiled stack (kvforge/sparsity/decode.py) equals the Python layers
masked the same way (kvforge/sparsity/masking.py) on decode steps, one-step and multi-step."""
from __future__ import annotations

import pytest
import torch

import kvforge.kernels as kernels
from kvforge.sparsity.calibrate import calibrate
from kvforge.sparsity.decode import enable_sparse_decode
from kvforge.sparsity.masking import SparsityMasks
from tests.kernels.test_cpu_kernels import _greedy, _kernels_off, needs_kernels

pytestmark = needs_kernels

PROMPTS = [[5, 17, 300, 42, 9, 11], list(range(100, 140)), [7] * 19]


def _llm(hf_dir, **kw):
    from kvforge.engine.llm import LLM
    return LLM(hf_dir, num_kv_blocks=64, block_size=4, **kw)


def _thresholds(llm, sparsity, mode):
    model = llm.engine.runner.model
    ids = torch.randint(3, 1000, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    return calibrate(model, ids, sparsity, mode, window=200)


def _masked_reference(llm, thresholds, monkeypatch, max_tokens):
    """Greedy output of the Python layers, decode steps masked (prefill dense)."""
    with monkeypatch.context() as m:
        _kernels_off(llm, m)
        with SparsityMasks(llm.engine.runner.model, thresholds, max_rows=4) as masks:
            out = _greedy(llm, PROMPTS, max_tokens=max_tokens)
        assert masks.realised(), "the reference masked nothing"
    return out


def assert_stack_equals_masked_layers(llm, thresholds, monkeypatch) -> None:
    """The compiled sparse decode's greedy tokens and logprobs (to 1e-4) are the masked
    Python layers', and differ from the dense engine's (at S = 0.5 the masks change this
    random model's tokens)."""
    dense, _ = _greedy(llm, PROMPTS, max_tokens=10)
    assert enable_sparse_decode(llm.engine.runner.model, thresholds) > 0
    sparse, sparse_lp = _greedy(llm, PROMPTS, max_tokens=10)
    ref, ref_lp = _masked_reference(llm, thresholds, monkeypatch, max_tokens=10)
    assert sparse == ref
    for a, b in zip(sparse_lp, ref_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)
    assert sparse != dense
    llm.engine.check_integrity()


@pytest.mark.parametrize("mode", ["teal", "cats"])
@pytest.mark.parametrize("steps", [1, 4])            # one-step and multi-step decoding
def test_sparse_stack_equals_masked_python_layers(tiny_model_factory, monkeypatch, mode, steps):
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir, num_decode_steps=steps)
    assert_stack_equals_masked_layers(llm, _thresholds(llm, 0.5, mode), monkeypatch)


@pytest.mark.parametrize("steps", [1, 4])
def test_gemma3_teal_stack_equals_masked_python_layers(tiny_model_factory, monkeypatch, steps):
    """Gemma 3's decode stack takes the same sparse projections between its own extras (q/k
    head norms, post-attention / post-MLP norms, gelu-tanh, windows) and equals its masked
    Python layers."""
    from tests.exit.conftest import GEMMA3
    hf_dir, _ = tiny_model_factory("gemma3", num_hidden_layers=4, **GEMMA3)
    llm = _llm(hf_dir, num_decode_steps=steps)
    assert_stack_equals_masked_layers(llm, _thresholds(llm, 0.5, "teal"), monkeypatch)


def test_cats_on_a_gelu_gate_is_refused(tiny_model_factory):
    from tests.exit.conftest import GEMMA3
    hf_dir, _ = tiny_model_factory("gemma3", num_hidden_layers=4, **GEMMA3)
    llm = _llm(hf_dir)
    with pytest.raises(ValueError, match="mode 'cats' thresholds .silu.gate..; "
                                         "Gemma3ForCausalLM gates its MLP with "
                                         "'gelu_pytorch_tanh': use mode 'teal'"):
        _thresholds(llm, 0.5, "cats")


def test_qwen2_biases_sparse(tiny_model_factory, monkeypatch):
    """q|k|v biases are added after the sparse product."""
    hf_dir, _ = tiny_model_factory("qwen2")
    llm = _llm(hf_dir)
    thresholds = _thresholds(llm, 0.4, "teal")
    enable_sparse_decode(llm.engine.runner.model, thresholds)
    sparse, sparse_lp = _greedy(llm, PROMPTS, max_tokens=8)
    ref, ref_lp = _masked_reference(llm, thresholds, monkeypatch, max_tokens=8)
    assert sparse == ref
    for a, b in zip(sparse_lp, ref_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["teal", "cats"])
def test_int8_projections_run_sparse_in_the_stack(tiny_model_factory, monkeypatch, mode):
    """int8 layers (otherwise called back as Python modules) run the sparse int8 kernel inside
    the team step; the reference is the int8 Python layers masked alike (bf16 activations
    there, fp32 here: logprobs agree to bf16 rounding)."""
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir, quantization="int8")
    assert_int8_stack_near_masked_layers(llm, _thresholds(llm, 0.5, mode), monkeypatch)


def assert_int8_stack_near_masked_layers(llm, thresholds, monkeypatch) -> None:
    """An int8 engine's sparse decode: logprobs within bf16 rounding (5e-2) of the masked int8
    Python layers', and far from the dense int8 engine's (the steps really ran sparse)."""
    _, dense_lp = _greedy(llm, PROMPTS, max_tokens=6)
    assert enable_sparse_decode(llm.engine.runner.model, thresholds) > 0
    _, sparse_lp = _greedy(llm, PROMPTS, max_tokens=6)
    _, ref_lp = _masked_reference(llm, thresholds, monkeypatch, max_tokens=6)
    for a, b in zip(sparse_lp, ref_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=5e-2)
    gap = max(abs(a - b) for x, y in zip(sparse_lp, dense_lp) for a, b in zip(x[1:], y[1:]))
    assert gap > 0.005         # exactly 0.0 when the step ran dense


def test_zero_thresholds_keep_dense_tokens(tiny_model_factory):
    """S = 0 thresholds (only exact zeros skipped) through the sparse kernels: the dense
    greedy tokens, logprobs to float rounding."""
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir)
    dense, dense_lp = _greedy(llm, PROMPTS, max_tokens=10)
    zero = _thresholds(llm, 0.5, "teal")
    zero.layers = {k: [0.0] * len(v) for k, v in zero.layers.items()}
    enable_sparse_decode(llm.engine.runner.model, zero)
    sparse, sparse_lp = _greedy(llm, PROMPTS, max_tokens=10)
    assert sparse == dense
    for a, b in zip(sparse_lp, dense_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-4)


def test_rows_beyond_the_sparse_limit_stay_dense(tiny_model_factory):
    """A batch of more sequences than sparse_rows_max decodes dense: its tokens are the dense
    engine's even with thresholds that change a batch of few rows."""
    hf_dir, _ = tiny_model_factory("llama")
    llm = _llm(hf_dir)
    batch = PROMPTS * 2                                 # 6 rows > 4
    dense, _ = _greedy(llm, batch, max_tokens=8)
    enable_sparse_decode(llm.engine.runner.model, _thresholds(llm, 0.6, "teal"))
    assert _greedy(llm, batch, max_tokens=8)[0] == dense
    assert _greedy(llm, PROMPTS, max_tokens=8)[0] != dense[:3]
