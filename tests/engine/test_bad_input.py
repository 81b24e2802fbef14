"""Bad input gives a clear error naming the problem and never corrupts engine state."""
from __future__ import annotations

import os

import pytest

from kvforge import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path, _ = tiny_model_factory("llama")
    return LLM(path, block_size=4, num_kv_blocks=64, max_model_len=64)


def _still_serves(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == 64
    assert not llm.engine.has_unfinished_requests()


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)
    _still_serves(llm)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="64"):
        llm.generate([[5, 6, 7], list(range(3, 80))], SamplingParams(max_tokens=4), use_tqdm=False)
    _still_serves(llm)


def test_token_id_outside_vocab(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 10**9]], SamplingParams(max_tokens=4), use_tqdm=False)
    _still_serves(llm)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.5), "temperature"), (dict(n=0), "n"), (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty")])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_corrupt_gguf(tmp_path, default_model_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated.gguf"):
        LLM(str(truncated))


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(None, max_num_seq=4)


def test_device_that_is_not_there_or_not_a_device():
    import torch
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        EngineConfig(device="gpu0")
    missing = "cuda:7" if torch.cuda.is_available() else "cuda"
    if torch.cuda.device_count() <= 7:
        with pytest.raises(ValueError, match=f"device '{missing}'"):
            EngineConfig(device=missing)
    assert EngineConfig(device="cpu").device == "cpu"
