"""Chunked long-text NLL (kvforge/eval/long_nll.py) against the one-prefill evaluator and the
engine's own prompt logprobs, on a tiny model with a 64-token context."""
from __future__ import annotations

import random

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.attention.window import AttentionWindow
from kvforge.eval.long_nll import chunked_nll, set_window
from kvforge.eval.perplexity import window_nll

BLOCK = 4
STREAMING = AttentionWindow(4, 16)


@pytest.fixture(scope="module")
def streaming(tiny_model_factory):
    path, _ = tiny_model_factory("llama", max_position_embeddings=64, initializer_range=0.1)
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=32,
              attention_sinks=4, sliding_window=16)
    # the model's own greedy text (random ids would be scored near-uniformly by any attention)
    prompt = [random.Random(5).randrange(3, 49152) for _ in range(8)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=192, ignore_eos=True),
                       use_tqdm=False)[0]
    return llm, prompt + out.outputs[0].token_ids


def test_dense_chunks_equal_one_prefill(streaming):
    llm, ids = streaming
    model = llm.engine.runner.model
    result = chunked_nll(model, ids[:60], None, chunk=7, block_size=BLOCK)
    set_window(model, None)
    total, count = window_nll(model, ids[:60], block_size=BLOCK)
    assert count == 59 == len(result.nll)
    assert abs(float(result.nll.sum()) - total) < 1e-3 * abs(total)
    assert result.max_held_blocks == 15                  # dense: the whole text


def test_streaming_nll_past_the_context_matches_the_engine(streaming):
    llm, ids = streaming
    model = llm.engine.runner.model
    small = chunked_nll(model, ids, STREAMING, chunk=16, block_size=BLOCK)
    whole = chunked_nll(model, ids, STREAMING, chunk=199, block_size=BLOCK)
    torch.testing.assert_close(small.nll, whole.nll, rtol=1e-4, atol=1e-4)
    assert small.max_held_blocks <= STREAMING.max_live_blocks(BLOCK, 16) == 10
    assert torch.isfinite(small.nll).all()
    # the engine, chunked by its own scheduler, gives the same per-token logprobs
    set_window(model, STREAMING)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    engine_nll = torch.tensor([-lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:])],
                              dtype=torch.float64)
    torch.testing.assert_close(small.nll, engine_nll, rtol=1e-4, atol=1e-4)
    # and it differs from dense past the window (positions >= S + W = 20)
    dense = chunked_nll(model, ids[:64], None, chunk=16, block_size=BLOCK)
    torch.testing.assert_close(small.nll[:19], dense.nll[:19], rtol=1e-4, atol=1e-4)
    assert (small.nll[19:63] - dense.nll[19:63]).abs().max() > 1e-3


def test_bad_arguments_raise(streaming):
    llm, ids = streaming
    model = llm.engine.runner.model
    with pytest.raises(ValueError, match="chunk >= 1"):
        chunked_nll(model, ids, STREAMING, chunk=0)
    with pytest.raises(ValueError, match="cannot hold a chunk"):
        chunked_nll(model, ids, STREAMING, chunk=16, block_size=BLOCK, num_blocks=3)
    with pytest.raises(ValueError, match="no windowed attention backend"):
        set_window(torch.nn.Linear(2, 2), None)


def test_decode_ranges_score_like_chunks(streaming):
    # one-token decode steps over two ranges give the chunked prefill's NLL and top-1
    llm, ids = streaming
    model = llm.engine.runner.model
    chunks = chunked_nll(model, ids[:80], None, chunk=16, block_size=BLOCK)
    decodes = chunked_nll(model, ids[:80], None, chunk=16, block_size=BLOCK,
                          decode_ranges=[(5, 21), (60, 79)])
    torch.testing.assert_close(decodes.nll, chunks.nll, rtol=1e-4, atol=1e-4)
    assert torch.equal(decodes.top1, chunks.top1)
    assert 0 < int(chunks.top1.sum()) < len(chunks.top1)      # the model's own text: mostly hits
    with pytest.raises(ValueError, match="decode range"):
        chunked_nll(model, ids[:80], None, chunk=16, block_size=BLOCK, decode_ranges=[(70, 90)])


@pytest.mark.slow
def test_quest_changes_only_decode_positions(default_model_path):
    # the real model on 600 tokens of The Tempest: QUEST at a 64-token budget changes the
    # scores of the decode steps (and nothing before them); a budget covering the context
    # scores exactly like dense
    from kvforge.attention.quest import configure_quest
    from kvforge.eval.corpus import load_corpus
    llm = LLM(default_model_path, sparse_attention="quest", sparse_token_budget=10**6,
              kv_cache_memory="64MiB", max_model_len=1024)
    ids = llm.engine.tokenizer.encode(load_corpus("shakespeare"))[:600]
    model = llm.engine.runner.model
    ranges = [(570, 599)]
    dense = chunked_nll(model, ids, None, chunk=256, decode_ranges=ranges)
    configure_quest(model, token_budget=64, dense_layers=2)
    sparse = chunked_nll(model, ids, None, chunk=256, decode_ranges=ranges)
    configure_quest(model, token_budget=10**6, dense_layers=2)
    full = chunked_nll(model, ids, None, chunk=256, decode_ranges=ranges)
    assert torch.equal(sparse.nll[:570], dense.nll[:570])          # prefill chunks: dense
    assert (sparse.nll[570:] - dense.nll[570:]).abs().max() > 1e-3  # 64 of ~590 tokens read
    assert torch.equal(full.nll, dense.nll) and torch.equal(full.top1, dense.top1)


@pytest.mark.parametrize("backend", ["paged", "quest"])
def test_a_model_with_its_own_windows_keeps_them(backend):
    """Gemma 3's sliding layers window themselves: the NLL of a text past the window (8) is
    HF's, decode steps included (under QUEST: the window over QUEST's layout, the budget
    above the text); another window is refused, naming the model."""
    from kvforge.attention.quest import configure_quest
    from kvforge.models.config import ModelConfig
    from kvforge.models.gemma3 import Gemma3ForCausalLM
    from tests.models.test_gemma3 import make_hf
    hf = make_hf()
    d = hf.config.to_dict()
    d["architectures"] = ["Gemma3ForCausalLM"]
    ours = Gemma3ForCausalLM(ModelConfig.from_hf_dict(d), attn_backend=backend)
    ours.load_weights(hf.state_dict().items())
    if backend == "quest":
        assert configure_quest(ours, token_budget=1024, dense_layers=0) == 1
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    r = chunked_nll(ours, ids.tolist(), None, chunk=7, block_size=4, decode_ranges=[(20, 30)])
    with torch.inference_mode():
        logits = hf(ids[None]).logits[0, :-1].double()
    expected = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    torch.testing.assert_close(r.nll, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM windows its own"):
        set_window(ours, AttentionWindow(2, 16))
