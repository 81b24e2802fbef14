"""Attention windows through the whole engine: a model's native sliding window against HF
transformers, StreamingLLM (sinks + window) past the model's context with bounded KV blocks."""
from __future__ import annotations

import math
import random

import pytest

from kvforge import LLM, SamplingParams
from kvforge.attention.window import AttentionWindow
from kvforge.attention.windowed import WindowedAttentionBackend
from kvforge.config import EngineConfig
from tests.helpers.engine_watch import run_and_watch
from tests.helpers.hf_oracle import hf_greedy
from tests.kernels.test_cpu_kernels import _kernels_off

BLOCK = 4
MAX_TOKENS = 24


def random_prompts(seed: int, lengths=(5, 33, 18, 47)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def backends(llm):
    return [layer.self_attn.attn for layer in llm.engine.runner.model.model.layers]


# ------------------------------------------------------------------ native sliding window
@pytest.fixture(scope="module")
def mistral_window(tiny_model_factory):
    """Tiny Mistral with sliding_window 8, and HF's greedy outputs with and without it."""
    path, hf = tiny_model_factory("mistral", sliding_window=8, initializer_range=0.1)
    _, hf_full = tiny_model_factory("mistral", sliding_window=None, initializer_range=0.1)
    prompts = random_prompts(0)
    refs = [hf_greedy(hf, p, MAX_TOKENS)[0] for p in prompts]
    full = [hf_greedy(hf_full, p, MAX_TOKENS)[0] for p in prompts]
    return path, prompts, refs, full


def test_hf_applies_the_window(mistral_window):
    _, _, refs, full = mistral_window
    # same weights: every prompt + output outgrows the 8-token window, so HF's output changes
    assert all(r != f for r, f in zip(refs, full))


@pytest.mark.parametrize("schedule", [
    dict(),                                                   # whole prompts in one step
    dict(max_num_batched_tokens=8, max_num_seqs=3),           # chunked prefill
    dict(enable_chunked_prefill=False),
    dict(num_kv_blocks=8),                                    # preemption by recompute
], ids=["batched", "chunked", "no_chunking", "preempting"])
def test_native_window_matches_hf_and_frees_blocks(mistral_window, schedule):
    path, prompts, refs, _ = mistral_window
    llm = LLM(path, block_size=BLOCK, **{"num_kv_blocks": 128, **schedule})
    window = llm.engine.kv_manager.window
    assert window == AttentionWindow(0, 8, "true")
    assert all(b.window == window for b in backends(llm))
    assert llm.engine.kv_manager.prefix_cache is None, "freed blocks cannot be shared"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, most_held, _ = run_and_watch(llm, prompts, params)
    assert tokens == refs
    if schedule.get("num_kv_blocks"):
        assert llm.engine.num_preemptions_total > 0, "pool meant to preempt"
    # the longest request (47 + 24 tokens) would hold 18 blocks without the window
    chunk = llm.engine.scheduler.config.max_num_batched_tokens
    assert most_held <= window.max_live_blocks(BLOCK, min(chunk, 47))
    if schedule.get("max_num_batched_tokens") == 8:
        assert most_held <= window.max_live_blocks(BLOCK, 8) == 5


def test_qwen2_window_on_upper_layers_only_matches_hf(tiny_model_factory):
    # HF Qwen2: layers >= max_window_layers slide; layer 0 attends to everything, so no block
    # can be freed and the prefix cache stays on
    path, hf = tiny_model_factory("qwen2", use_sliding_window=True, sliding_window=8,
                                  max_window_layers=1, initializer_range=0.1)
    prompts = random_prompts(1, lengths=(30, 12))
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=8)
    assert [b.window for b in backends(llm)] == [None, AttentionWindow(0, 8, "true")]
    assert llm.engine.kv_manager.window is None and llm.engine.kv_manager.prefix_cache is not None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens, _, _ = run_and_watch(llm, prompts, params)
    assert tokens == [hf_greedy(hf, p, 16)[0] for p in prompts]


def test_window_at_least_the_context_is_plain_attention(tiny_model_factory):
    path, _ = tiny_model_factory("mistral", sliding_window=600, initializer_range=0.1)
    llm = LLM(path, block_size=BLOCK, num_kv_blocks=16)          # context 512 <= 600
    assert not any(isinstance(b, WindowedAttentionBackend) for b in backends(llm))
    assert llm.engine.kv_manager.window is None


# ------------------------------------------------------------------ StreamingLLM
@pytest.fixture(scope="module")
def short_context(tiny_model_factory):
    path, _ = tiny_model_factory("llama", max_position_embeddings=64, initializer_range=0.1)
    return path


def streaming_llm(path, **kwargs):
    return LLM(path, block_size=BLOCK, attention_sinks=4, sliding_window=16,
               **{"num_kv_blocks": 64, "max_num_batched_tokens": 32, **kwargs})


def test_streaming_generates_past_the_context_with_bounded_blocks(short_context):
    llm = streaming_llm(short_context)
    engine = llm.engine
    assert engine.max_len_per_request > 64
    prompt = random_prompts(2, lengths=(10,))
    params = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True, logprobs=1)
    [tokens], most_held, [logprobs] = run_and_watch(llm, prompt, params)
    assert len(tokens) == 320                                  # 330 positions, context 64
    # the compiled whole-step decode (kernels/decode_stack.py) runs the window and the sinks
    from kvforge import kernels
    assert (engine.runner.model._decode_stack is not None) == (kernels.cpu_kernels() is not None)
    assert most_held <= -(-(4 + 16) // BLOCK) + 1 == 6         # S + W tokens, one partial block
    chosen = [lp[t] for lp, t in zip(logprobs, tokens)]
    assert all(math.isfinite(x) for x in chosen)
    assert len(set(tokens)) > 100, "generation collapsed into a loop"
    # until a query's window first drops a key (position S + W = 20, output 11) it is dense
    dense = LLM(short_context, block_size=BLOCK, num_kv_blocks=64)
    ref = dense.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)[0].outputs[0]
    assert tokens[:11] == ref.token_ids[:11]
    gaps = [abs(a[t] - b[t]) for a, b, t in zip(logprobs[11:], ref.logprobs[11:], tokens[11:])
            if t in b]
    assert gaps and max(gaps) > 1e-3, "the window was meant to change the distribution"


def test_streaming_output_does_not_depend_on_chunks_batching_forks_or_preemption(short_context):
    # prompts longer than the model's context; token-exact masks make every schedule agree
    prompts = random_prompts(3, lengths=(100, 7, 70))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected, _, _ = run_and_watch(streaming_llm(short_context, max_num_batched_tokens=128),
                                   prompts, params)
    chunked, _, _ = run_and_watch(streaming_llm(short_context, max_num_batched_tokens=8),
                                  prompts, params)
    assert chunked == expected
    alone = [run_and_watch(streaming_llm(short_context), [p], params)[0][0] for p in prompts]
    assert alone == expected
    llm = streaming_llm(short_context, num_kv_blocks=14, max_num_batched_tokens=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool meant to preempt"
    llm.engine.check_integrity()
    # n = 2 forks after the 100-token prompt: the parent's table already has released entries
    llm = streaming_llm(short_context)
    out = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 2
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == 64


@pytest.mark.parametrize("path", ["decode stack", "python layers"])
def test_streaming_with_ngram_speculation_matches_streaming_alone(short_context, monkeypatch,
                                                                  path):
    """n-gram guesses under StreamingLLM: verification rows attend each through its own window
    (the compiled stack's rows, or the Python layers' multi-token chunks), rejected lookahead
    slots are trimmed while the blocks behind the window are freed, and the greedy tokens are
    those of StreamingLLM alone, past the model's context."""
    import kvforge.models.compiled_decode as compiled_decode
    from kvforge import kernels
    rng = random.Random(7)
    motif = [rng.randrange(3, 49152) for _ in range(6)]
    prompts = [motif * 6 + [rng.randrange(3, 49152) for _ in range(5)],
               [rng.randrange(3, 49152) for _ in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    expected, _, _ = run_and_watch(streaming_llm(short_context), prompts, params)
    llm = streaming_llm(short_context, speculative_method="ngram", num_speculative_tokens=4)
    engine = llm.engine
    engine.spec.cost, engine.spec.min_acceptance, engine.spec.guard = None, 0.0, None
    stack_rows = []
    real = compiled_decode.run_decode_stack

    def spy(stack, model, input_ids, positions, kv_caches, meta):
        stack_rows.append(max(meta.query_lens_list))
        return real(stack, model, input_ids, positions, kv_caches, meta)
    monkeypatch.setattr(compiled_decode, "run_decode_stack", spy)
    if path == "python layers":
        _kernels_off(llm, monkeypatch)
    got, most_held, _ = run_and_watch(llm, prompts, params, decoding_only=True)
    assert got == expected
    stats = engine.spec_stats
    assert stats.num_accepted > 0 and stats.num_proposed > stats.num_accepted
    window = AttentionWindow(4, 16)
    assert most_held <= window.max_live_blocks(BLOCK, 1 + 4)
    verified_in_stack = any(rows > 1 for rows in stack_rows)
    assert verified_in_stack == (path == "decode stack" and kernels.cpu_kernels() is not None)


def test_streaming_prompt_shorter_than_the_sinks_on_the_python_layers(short_context,
                                                                       monkeypatch):
    """A prefill whose last token is still among the sinks has no window columns (the Python
    backend's tile built an empty range backwards and raised); the compiled stack's tokens."""
    prompts = [[7, 8], [9, 10, 11]]                     # 2 and 3 tokens, 4 sinks
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected, _, _ = run_and_watch(streaming_llm(short_context), prompts, params)
    llm = streaming_llm(short_context)
    _kernels_off(llm, monkeypatch)
    got, _, _ = run_and_watch(llm, prompts, params)
    assert got == expected


# ------------------------------------------------------------------ fp8 K/V under windows
@pytest.mark.parametrize("kind", ["native", "streaming"])
def test_windows_over_an_fp8_cache_do_not_depend_on_the_schedule(mistral_window, short_context,
                                                                 kind):
    """A model's own window (Mistral) and StreamingLLM over 8-bit K/V: every layer windowed
    over fp8 storage, blocks freed as in fp32, and the same tokens whether prompts run whole,
    in chunks of 8 or through preemption (new K/V are rounded before attention)."""
    from kvforge.quant.fp8_kv import FP8KVCache
    if kind == "native":
        path, prompts = mistral_window[0], mistral_window[1]
        make = lambda **kw: LLM(path, block_size=BLOCK, kv_cache_dtype="fp8_e4m3",  # noqa: E731
                                **{"num_kv_blocks": 128, **kw})
    else:
        path, prompts = short_context, random_prompts(3, lengths=(100, 7, 70))
        make = lambda **kw: streaming_llm(path, kv_cache_dtype="fp8_e4m3", **kw)   # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make()
    assert all(isinstance(b, WindowedAttentionBackend) and isinstance(b, FP8KVCache)
               for b in backends(llm))
    assert llm.engine.kv_manager.window is not None
    expected, most_held, _ = run_and_watch(llm, prompts, params)
    assert most_held <= llm.engine.kv_manager.window.max_live_blocks(
        BLOCK, llm.engine.scheduler.config.max_num_batched_tokens)
    chunked, _, _ = run_and_watch(make(max_num_batched_tokens=8, max_num_seqs=2), prompts,
                                  params)
    assert chunked == expected
    small = make(num_kv_blocks=8 if kind == "native" else 14, max_num_batched_tokens=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool meant to preempt"
    small.engine.check_integrity()
    assert small.engine.num_free_blocks == small.engine.runner.num_blocks


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_sinks=-1, sliding_window=16), "attention_sinks must be an integer >= 0"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
    (dict(sliding_window=8, block_size=16), "smaller than one KV block"),
    (dict(attention_sinks=4), "needs a sliding_window"),
    (dict(sliding_window=64, sparse_attention="quest"), "cannot be combined"),
    (dict(sliding_window=64, speculative_method="draft"), "n-gram or early-exit speculation"),
    (dict(sliding_window=64, preemption_mode="swap"), "preemption_mode='swap'"),
])
def test_config_rejects_bad_window_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_engine_rejects_windows_the_model_cannot_run(short_context, tiny_model_factory):
    with pytest.raises(ValueError, match="sinks \\+ window = 68 tokens exceeds the model's "
                                         "context of 64"):
        LLM(short_context, block_size=BLOCK, attention_sinks=4, sliding_window=64)
    gpt2, _ = tiny_model_factory("gpt2")
    with pytest.raises(ValueError, match="needs a Llama-family model"):
        LLM(gpt2, block_size=BLOCK, sliding_window=16)


def test_bad_request_leaves_a_streaming_engine_clean(short_context):
    llm = streaming_llm(short_context)
    engine = llm.engine
    engine.add_request("ok", random_prompts(4, lengths=(30,))[0],
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [5, 10**6], SamplingParams(max_tokens=4))
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.num_free_blocks == 64


def test_cli_flags_reach_the_engine_config(tmp_path, capsys):
    from kvforge.cli import main
    from tests.helpers.cli import engine_config_from_flags
    config = engine_config_from_flags(["--attention-sinks", "4", "--sliding-window", "1024"])
    assert (config.attention_sinks, config.sliding_window) == (4, 1024)
    assert engine_config_from_flags([]).sliding_window is None
    rc = main(["generate", "x", "--model", str(tmp_path / "m"), "--attention-sinks", "4"])
    assert rc == 2 and "needs a sliding_window" in capsys.readouterr().err
