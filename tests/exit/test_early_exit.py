"""Lossy early exit: a threshold no token reaches decodes like the plain engine; a low one skips
layers, fills the skipped layers' K/V consistently and leaks no blocks; bad settings fail."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.eval.perplexity import forward_in_chunks
from kvforge.exit.model import EarlyExitLM, describe_exits

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [12, 12, 12, 400], list(range(100, 131))]


def _run(path, **kwargs):
    llm = LLM(path, block_size=4, num_kv_blocks=128, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_unreachable_threshold_equals_plain_decoding(tiny_path, saved_heads):
    plain, _ = _run(tiny_path)
    tokens, engine = _run(tiny_path, early_exit_threshold=1.0)
    stats = engine.runner.model.stats
    assert stats.rows > 0 and stats.exits == {}, stats       # checked every decode, none left
    assert stats.skipped_fraction == 0.0
    assert tokens == plain


def test_low_threshold_skips_layers_without_leaking(tiny_path, saved_heads):
    tokens, engine = _run(tiny_path, early_exit_threshold=1e-6)
    stats = engine.runner.model.stats
    # every decode leaves at the first head (after layer 1 of 4): 3/4 of its layers skipped
    assert stats.exits == {1: stats.rows} and stats.rows >= 3 * 11
    assert stats.skipped_fraction == pytest.approx(0.75)
    assert "layers skipped: 75.0%" in describe_exits(stats)
    assert all(len(t) == 12 for t in tokens)


def _exit_all(model, heads, threshold):
    return EarlyExitLM(model, heads, threshold, exit_all_rows=True)


def _median_confidence(model, heads, ids) -> float:
    """The median top-1 probability of the first head over ``ids``: a threshold half of them
    reach (a random model's probabilities are tiny, so no fixed value would split them)."""
    from kvforge.exit.train import collect_streams
    streams, _ = collect_streams(model, ids, [1], window=len(ids), progress=False)
    conf = torch.softmax(model.compute_logits(heads[1](streams[1])), -1).amax(-1)
    return float(conf.median())


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_and_token_by_token_agree(tiny_fp32, saved_heads, mixed):
    """One forward over mixed exits (some rows exit, others run on) and one row at a time (all
    or nothing per forward, K/V-only layers) give the same outputs and the same caches."""
    _, model = tiny_fp32
    tokens = torch.tensor(PROMPTS[2])
    threshold = _median_confidence(model, saved_heads, PROMPTS[2]) if mixed else 1e-6
    outs, caches = [], []
    for chunk in (len(tokens), 1):
        ee = _exit_all(model, saved_heads, threshold)
        kv = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in range(model.num_layers)]
        hidden = forward_in_chunks(ee, tokens, kv, 4, chunk)
        outs.append(model.compute_logits(hidden))
        caches.append(kv)
        stats = ee.stats
    if mixed:                  # a mix: some rows left at a head, others ran to the end
        assert 0 < sum(stats.exits.values()) < stats.rows, stats.exits
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_skipped_layers_hold_kv_of_the_exit_stream(tiny_fp32, saved_heads):
    """An exited token's K at a skipped layer is that layer's K projection of the exit stream,
    not zeros and not the K of the full forward."""
    _, model = tiny_fp32
    tokens = torch.tensor(PROMPTS[0])
    kv_full = [torch.zeros(model.kv_cache_shape(4, 4)) for _ in range(model.num_layers)]
    kv_exit = [torch.zeros(model.kv_cache_shape(4, 4)) for _ in range(model.num_layers)]
    forward_in_chunks(model, tokens, kv_full, 4, len(tokens))
    forward_in_chunks(_exit_all(model, saved_heads, 1e-6), tokens, kv_exit, 4, len(tokens))
    n = len(tokens)
    k_full = kv_full[3][0].reshape(-1, *kv_full[3].shape[-2:])[:n]
    k_exit = kv_exit[3][0].reshape(-1, *kv_exit[3].shape[-2:])[:n]
    assert k_exit.abs().sum() > 0
    assert not torch.allclose(k_exit, k_full, atol=1e-3)
    # layer 1 (before the exit) ran in full for every token
    torch.testing.assert_close(kv_exit[0], kv_full[0])


def _own_layer(layer, stream, rotary, cos, sin, cache, meta):
    """The model's own layer forward on rows whose residual stream is ``stream`` (what it
    caches is the reference for a skipped layer's K/V; Gemma 3's layers carry no residual)."""
    from kvforge.models.gemma3 import Gemma3DecoderLayer
    if isinstance(layer, Gemma3DecoderLayer):
        return layer(stream, rotary, cos, sin, cache, meta)
    return layer(torch.zeros_like(stream), stream, rotary, cos, sin, cache, meta)


def test_skipped_layer_kv_is_what_the_layer_itself_caches_for_the_exit_stream(tiny_fp32,
                                                                              saved_heads):
    """Every row exits after layer 1; each later layer's cached K/V equal what that layer's own
    forward writes for the exit stream (Gemma 3: k normed, its layer's RoPE base), the stream
    taken from the model's own first layer and exit head input."""
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.exit.train import collect_streams
    _, model = tiny_fp32
    tokens = torch.tensor(PROMPTS[2])
    n, blocks = len(tokens), -(-len(tokens) // 4)
    kv_exit = [torch.zeros(model.kv_cache_shape(blocks, 4)) for _ in range(model.num_layers)]
    ee = _exit_all(model, saved_heads, 1e-6)
    forward_in_chunks(ee, tokens, kv_exit, 4, n)
    assert ee.stats.exits == {1: n}
    streams, _ = collect_streams(model, PROMPTS[2], [1], window=n, progress=False)
    meta = AttentionMetadata.build([n], [0], [list(range(blocks))], 4, tokens.device)
    stack = model.model
    for j in range(1, model.num_layers):
        layer = stack.layers[j]
        rotary = getattr(stack, "rotary_emb", None)
        if rotary is None:                                    # Gemma 3: RoPE by layer type
            rotary = (stack.rotary_local if layer.layer_type == "sliding_attention"
                      else stack.rotary_global)
        cos, sin = (rotary.cos_sin(meta.positions()) if hasattr(stack, "rotary_emb")
                    else rotary.cos_sin(meta.positions(), torch.float32))
        reference = torch.zeros_like(kv_exit[j])
        _own_layer(layer, streams[1], rotary, cos, sin, reference, meta)
        torch.testing.assert_close(kv_exit[j], reference, rtol=1e-5, atol=1e-5)


def test_streams_collected_layer_by_layer_end_where_the_model_does(tiny_fp32):
    """exit/train.py runs the layers one by one (models/layerwise.py); its final hidden states
    are the model's own forward's (embedding scale, RoPE per layer, final norm)."""
    from kvforge.exit.train import collect_streams
    _, model = tiny_fp32
    ids = PROMPTS[2]
    _, final = collect_streams(model, ids, [1, 2], window=len(ids), progress=False)
    kv = [torch.zeros(model.kv_cache_shape(8, 4)) for _ in range(model.num_layers)]
    own = forward_in_chunks(model, torch.tensor(ids), kv, 4, len(ids))
    torch.testing.assert_close(final, own, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.01, True, "0.9"])
def test_threshold_outside_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"early_exit_threshold must be in \(0, 1\]"):
        EngineConfig(early_exit_threshold=bad)


def test_lossy_exit_and_speculation_do_not_combine():
    with pytest.raises(ValueError, match="do not combine"):
        EngineConfig(early_exit_threshold=0.9, speculative_method="ngram")


def test_engine_without_trained_heads_says_so(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    with pytest.raises(FileNotFoundError, match="train-exit-heads"):
        LLM(path, block_size=4, num_kv_blocks=16, early_exit_threshold=0.9)


@pytest.mark.parametrize("method", ["lossy", "early-exit"])
def test_family_early_exit_does_not_run_is_refused_before_looking_for_heads(tiny_model_factory,
                                                                            method):
    """GPT-2 (learned positions, its own blocks): no heads can be trained for it, so the
    engine says that rather than asking for `kvforge train-exit-heads`."""
    path, _ = tiny_model_factory("gpt2")
    kw = (dict(early_exit_threshold=0.9) if method == "lossy"
          else dict(speculative_method="early-exit"))
    with pytest.raises(ValueError, match="early exit runs Llama-family decoders .* and Gemma 3 "
                                         "layer by layer; GPT2LMHeadModel is not supported"):
        LLM(path, block_size=4, num_kv_blocks=16, **kw)
