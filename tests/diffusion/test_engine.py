"""LLM / DiffusionEngine on a saved tiny model, and kvforge train-diffusion end to end."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvforge.diffusion.byte_tokenizer import EOS_ID, MASK_ID, VOCAB_SIZE
from kvforge.diffusion.commands import save_model
from kvforge.diffusion.generator import DiffusionGenerator
from kvforge.sampling_params import SamplingParams
from tests.diffusion.factories import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model(vocab_size=VOCAB_SIZE, mask_token_id=MASK_ID, eos_token_ids=[EOS_ID],
                       tie_word_embeddings=True)
    path = str(tmp_path_factory.mktemp("diffusion") / "tiny")
    save_model(model, path, {"note": "random"})
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    from kvforge import LLM
    return LLM(model_dir, num_threads=1)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_llm_picks_the_diffusion_engine_and_batches(llm, model_dir):
    from kvforge.diffusion.engine import DiffusionEngine
    assert isinstance(llm.engine, DiffusionEngine)
    prompts = ["To be, or", "Hello"]
    params = greedy(max_tokens=8, diffusion_block_length=4, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    direct = DiffusionGenerator(llm.engine.model).generate(
        [llm.tokenizer.encode(p) for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == direct.token_ids
    assert [o.outputs[0].text for o in outs] == [llm.tokenizer.decode(t) for t in direct.token_ids]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.stats.forwards == 8          # one batch of two, one token per step


def test_requests_with_different_loop_settings_run_in_separate_batches(llm):
    before = llm.engine.stats.forwards
    outs = llm.generate(["ab", "cd", "ef"],
                        [greedy(max_tokens=4, diffusion_block_length=4, ignore_eos=True),
                         greedy(max_tokens=8, diffusion_block_length=4, ignore_eos=True),
                         greedy(max_tokens=4, diffusion_block_length=4, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 8, 4]
    assert llm.engine.stats.forwards - before == 4 + 8


def test_output_stops_at_eos(llm):
    from types import SimpleNamespace
    from kvforge.diffusion.engine import _Running, _Waiting
    w = _Waiting("x", None, [1], greedy(max_tokens=6), 0.0)
    run = _Running(SimpleNamespace(done=False), [w], [0], [False], 0.0)
    out = llm.engine._output(run, 0, w, [72, 105, EOS_ID, 72, 72, 72])
    assert out.outputs[0].token_ids == [72, 105] and out.outputs[0].text == "Hi"
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == EOS_ID and out.deltas == ["Hi"]


def test_streams_block_by_block_and_holds_back_a_split_character(llm):
    from types import SimpleNamespace
    from kvforge.diffusion.engine import _Running, _Waiting
    w = _Waiting("x", None, [1], greedy(max_tokens=4, ignore_eos=True), 0.0)
    batch = SimpleNamespace(done=False)
    run = _Running(batch, [w], [0], [False], 0.0)
    first = llm.engine._output(run, 0, w, [72, 0xC3])          # "H" + half of "é"
    assert not first.finished and first.deltas == ["H"]
    batch.done = True
    last = llm.engine._output(run, 0, w, [72, 0xC3, 0xA9, 33])
    assert last.finished and last.deltas == ["é!"] and last.outputs[0].text == "Hé!"


def test_engine_steps_one_block_at_a_time(llm):
    engine = llm.engine
    params = greedy(max_tokens=8, diffusion_block_length=4, ignore_eos=True)
    engine.add_request("a", "Hello", params)
    engine.add_request("b", "Hi", params)
    first = engine.step()
    assert [len(o.outputs[0].token_ids) for o in first] == [4, 4]
    assert not any(o.finished for o in first) and engine.scheduler.num_running == 2
    second = engine.step()
    assert all(o.finished for o in second) and not engine.has_unfinished_requests()
    direct = DiffusionGenerator(engine.model).generate(
        [engine.tokenizer.encode("Hello"), engine.tokenizer.encode("Hi")], params)
    assert [o.outputs[0].token_ids for o in second] == direct.token_ids
    assert [first[i].deltas[0] + second[i].deltas[0] for i in range(2)] == [
        o.outputs[0].text for o in second]


def test_abort_mid_batch(llm):
    engine = llm.engine
    params = greedy(max_tokens=8, diffusion_block_length=4, ignore_eos=True)
    engine.add_request("a", "Hello", params)
    engine.add_request("b", "Hi", params)
    engine.step()
    engine.abort_request("a")
    assert [o.request_id for o in engine.step()] == ["b"]
    engine.add_request("c", "Hey", params)
    engine.step()
    engine.abort_request("c")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt,params,message", [
    ("", greedy(max_tokens=4), "prompt must not be empty"),
    ([MASK_ID], greedy(max_tokens=4), "not the mask token 257"),
    ("ab", SamplingParams(n=2, max_tokens=4), "n=2"),
    ("ab", greedy(max_tokens=4, logprobs=1), "logprobs is not supported"),
    ("ab", greedy(max_tokens=256), "exceeds the model's 256 positions"),
    ("ab", greedy(max_tokens=8, diffusion_block_length=4, diffusion_steps=3),
     "diffusion_steps (3) must be a multiple"),
])
def test_bad_requests_refused(llm, prompt, params, message):
    with pytest.raises(ValueError) as err:
        llm.generate([prompt], params, use_tqdm=False)
    assert message in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_saved_model_round_trips_in_llada_layout(model_dir, llm):
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LLaDAModelLM"]
    from safetensors import safe_open
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.transformer.blocks.0.attn_out.weight" in names
    assert "model.transformer.wte.weight" in names and "model.layers.0.mlp.up_proj.weight" not in names
    reference = tiny_model(vocab_size=VOCAB_SIZE, mask_token_id=MASK_ID, eos_token_ids=[EOS_ID],
                           tie_word_embeddings=True)
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(llm.engine.model.state_dict()[name], p, rtol=0, atol=0)


def test_dream_layout_loads_qwen2_names(tmp_path):
    from safetensors.torch import save_file
    from kvforge.loader.source import load_model_source
    from kvforge.models.diffusion_lm import load_diffusion_model
    model = tiny_model("dream", seed=3)
    cfg = model.config
    config = {"architectures": ["DreamModel"], "model_type": "Dream", "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "intermediate_size": cfg.intermediate_size, "mask_token_id": cfg.mask_token_id,
              "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.rms_norm_eps}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    loaded = load_diffusion_model(load_model_source(str(tmp_path)))
    assert loaded.config.logits_shift == 1 and loaded.config.qkv_bias
    ids = torch.tensor([[1, 2, 3, 4]])
    pos = torch.arange(4).unsqueeze(0)
    # the factory's model hides the mask column (-inf); every other logit must agree exactly
    torch.testing.assert_close(loaded(ids, pos)[..., :-1], model(ids, pos)[..., :-1],
                               rtol=0, atol=0)


def test_bad_config_refused(tmp_path):
    from kvforge.models.diffusion_config import DiffusionLMConfig
    with pytest.raises(ValueError, match="mask_token_id must be a token id in \\[0, 64\\), got 64"):
        DiffusionLMConfig("llada", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4,
                          num_kv_heads=4, intermediate_size=8, mask_token_id=64)
    with pytest.raises(ValueError, match="unsupported llada config options {'alibi': True}"):
        DiffusionLMConfig.from_hf_dict({"architectures": ["LLaDAModelLM"], "mask_token_id": 1,
                                        "alibi": True})
    with pytest.raises(ValueError, match="needs mask_token_id"):
        DiffusionLMConfig.from_hf_dict({"architectures": ["LLaDAModelLM"], "d_model": 8})


def test_train_diffusion_cli_saves_a_loadable_model(tmp_path, monkeypatch):
    from kvforge.cli import main
    from kvforge.engine.llm import LLM
    monkeypatch.setenv("KVFORGE_MODELS_DIR", str(tmp_path))
    assert main(["train-diffusion", "--steps", "2", "--hidden-size", "32", "--layers", "1",
                 "--intermediate-size", "64", "--batch", "2", "--seq-len", "32"]) == 0
    with open(tmp_path / "tiny-diffusion" / "training.json") as f:
        report = json.load(f)
    assert report["steps"] == 2 and report["parameters"] > 0
    out = LLM("tiny-diffusion", num_threads=1).generate(
        ["Hi"], greedy(max_tokens=4, diffusion_block_length=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 4


def test_server_serves_a_diffusion_model(model_dir):
    import httpx
    from kvforge.server.background import BackgroundServer
    server = BackgroundServer({"model": model_dir, "num_threads": 1})
    try:
        body = {"model": "model", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "diffusion_block_length": 4, "parallel_threshold": 0.9,
                "diffusion_cache": "dual"}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                diffusion_block_length=4, parallel_threshold=0.9,
                                diffusion_cache="dual")
        engine = server.engine.engine
        direct = DiffusionGenerator(engine.model).generate([engine.tokenizer.encode("Hello")],
                                                           params)
        assert choice["text"] == engine.tokenizer.decode(direct.token_ids[0])
        streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True},
                              timeout=60)
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
        bad = httpx.post(f"{server.url}/v1/completions",
                         json={**body, "diffusion_cache": "both"}, timeout=60)
        assert bad.status_code == 400 and "both" in bad.text
    finally:
        server.stop()


def test_cli_generate_streams_a_diffusion_model(model_dir, capsys):
    from kvforge.cli import main
    assert main(["generate", "Hello", "--model", model_dir, "--max-tokens", "8",
                 "--diffusion-block-length", "4", "--parallel-threshold", "0.5",
                 "--diffusion-cache", "prefix", "--num-threads", "1"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["generate", "Hello", "--model", model_dir, "--diffusion-cache", "both"]) == 2
    assert "diffusion_cache must be one of none, prefix, dual, got 'both'" in capsys.readouterr().err


def test_autoregressive_engine_options_refused(model_dir):
    from kvforge import LLM
    with pytest.raises(ValueError, match="'quantization': 'int8'.*do not apply"):
        LLM(model_dir, quantization="int8")
    with pytest.raises(ValueError, match="'speculative_method': 'ngram'"):
        LLM(model_dir, speculative_method="ngram")


def test_cli_info_describes_a_diffusion_model(model_dir, capsys):
    from kvforge.cli import main
    assert main(["info", model_dir]) == 0
    out = capsys.readouterr().out
    assert "masked diffusion, llada layout, mask token 257" in out
    assert "KV cache:       256 bytes per canvas position" in out   # K+V x 2 layers x 2 x 8 x 4 B
