"""Gemma 3 vs HF transformers (the oracle) on tiny random models built offline."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.attention.windowed import WindowedAttentionBackend
from kvforge.models.config import ModelConfig
from kvforge.models.gemma3 import Gemma3ForCausalLM, Gemma3Options
from kvforge.models.registry import get_model_class
from tests.models.test_llama import alloc_caches, hf_logits, run_step

S, F = "sliding_attention", "full_attention"
# head_dim (32) != hidden / heads (16) and query_pre_attn_scalar (24) != head_dim, so a
# wrong head size or attention scale shows; a window of 8 matters from the 9th token on
TINY_GEMMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                  max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=24,
                  layer_types=[S, S, F, S], initializer_range=0.1)

CASES = {
    "base": {},
    "softcap": {"final_logit_softcapping": 3.0},
    "untied": {"tie_word_embeddings": False},
    "mha_linear_global_rope": {"num_key_value_heads": 4, "rope_parameters": {
        F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        S: {"rope_type": "default", "rope_theta": 1e4}}},
}


def make_hf(seed: int = 0, **overrides) -> tf.Gemma3ForCausalLM:
    torch.manual_seed(seed)
    hf = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**TINY_GEMMA, **overrides})).eval()
    with torch.no_grad():
        # HF starts every norm at 0 (scale 1 + 0): make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return hf


def make_pair(seed: int = 0, **overrides):
    hf = make_hf(seed, **overrides)
    d = hf.config.to_dict()
    d["architectures"] = ["Gemma3ForCausalLM"]
    ours = Gemma3ForCausalLM(ModelConfig.from_hf_dict(d))
    ours.load_weights(hf.state_dict().items())
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_hf(case):
    hf, ours = make_pair(**CASES[case])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 40)]
    logits = run_step(ours, alloc_caches(ours), prompts, [0, 0], [0, 1])
    assert logits.shape == (45, 256)
    torch.testing.assert_close(logits[:5], hf_logits(hf, prompts[0]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[5:], hf_logits(hf, prompts[1]), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decodes_past_the_window_match_hf():
    """Seq 0 prefills in chunks of 6 and 5 then decodes to position 20 (the window of 8 slides
    over cached blocks); seq 1 prefills beside its decodes. Every step equals HF."""
    hf, ours = make_pair()
    caches = alloc_caches(ours)
    g = torch.Generator().manual_seed(2)
    seq0 = torch.randint(0, 256, (21,), generator=g).tolist()
    seq1 = torch.randint(0, 256, (12,), generator=g).tolist()
    ref0, ref1 = hf_logits(hf, seq0), hf_logits(hf, seq1)
    torch.testing.assert_close(run_step(ours, caches, [seq0[:6]], [0], [0]), ref0[:6],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(run_step(ours, caches, [seq0[6:11]], [6], [0]), ref0[6:11],
                               atol=1e-4, rtol=1e-4)
    out = run_step(ours, caches, [[seq0[11]], seq1], [11, 0], [0, 1])       # decode + prefill
    torch.testing.assert_close(out[0], ref0[11], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1:], ref1, atol=1e-4, rtol=1e-4)
    for pos in range(12, 21):
        out = run_step(ours, caches, [[seq0[pos]]], [pos], [0])
        torch.testing.assert_close(out[0], ref0[pos], atol=1e-4, rtol=1e-4)


def test_layers_get_their_window_and_rope_base():
    _, ours = make_pair()
    attns = [layer.self_attn.attn for layer in ours.model.layers]
    assert [type(a) is WindowedAttentionBackend for a in attns] == [True, True, False, True]
    assert attns[0].window.window == 8 and attns[0].window.sinks == 0
    assert ours.model.rotary_local.base == 1e4 and ours.model.rotary_global.base == 1e6
    assert attns[2].scale == pytest.approx(24 ** -0.5)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_options_from_transformers4_config_keys():
    """config.json as transformers 4.x wrote it (gemma-3-270m): rope_theta and
    rope_local_base_freq at the top level, the pattern as an int, no tie flag (tied)."""
    d = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=256,
             hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, sliding_window=16, rope_theta=1e6,
             rope_local_base_freq=1e4, sliding_window_pattern=6, query_pre_attn_scalar=32,
             hidden_activation="gelu_pytorch_tanh", rope_scaling=None)
    opts = Gemma3Options.from_config(ModelConfig.from_hf_dict(d))
    assert opts.layer_types == (S,) * 5 + (F, S)
    assert (opts.local_rope_base, opts.global_rope_base) == (1e4, 1e6)
    assert opts.tie_word_embeddings and opts.global_rope_scaling is None
    assert opts.hidden_activation == "gelu_pytorch_tanh"


@pytest.mark.parametrize("bad,match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"layer_types": [S, F]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_unsupported_or_invalid_configs_are_refused(bad, match):
    d = {**TINY_GEMMA, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **bad}
    with pytest.raises(ValueError, match=match):
        Gemma3ForCausalLM(ModelConfig.from_hf_dict(d))


def test_sliding_layers_refuse_other_backends():
    d = {**TINY_GEMMA, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    with pytest.raises(ValueError, match="tiled"):
        Gemma3ForCausalLM(ModelConfig.from_hf_dict(d), attn_backend="tiled")


def test_load_weights_rejects_missing_norm():
    hf, ours = make_pair()
    state = {k: v for k, v in hf.state_dict().items()
             if k != "model.layers.1.post_feedforward_layernorm.weight"}
    with pytest.raises(ValueError, match="post_feedforward_layernorm"):
        ours.load_weights(state.items())


def test_registry_names():
    assert get_model_class("Gemma3ForCausalLM") is Gemma3ForCausalLM
    assert get_model_class("gemma3") is Gemma3ForCausalLM


# ------------------------------------------------------------------ GGUF and the whole engine
def gguf_shaped_hf(**overrides) -> tf.Gemma3ForCausalLM:
    """A tiny model in the shape a GGUF can describe: llama.cpp's 5-local-to-1-global pattern
    (7 layers: 5 sliding, 1 full, 1 sliding) and queries scaled by head_dim (256, which is also
    what transformers assumes when it reads a gemma3 GGUF)."""
    from tests.loader.gguf_factory import gemma_vocabulary
    return make_hf(**{"vocab_size": len(gemma_vocabulary()), "num_hidden_layers": 7,
                      "layer_types": None, "head_dim": 256, "query_pre_attn_scalar": 256,
                      **overrides})


def gemma_files_in(d, hf: tf.Gemma3ForCausalLM) -> tuple[str, str]:
    """``hf`` written into directory ``d`` as a GGUF and as an HF directory with the GGUF's
    tokenizer: (GGUF path, HF directory)."""
    from kvforge.tokenizer import Tokenizer
    from tests.loader.gguf_factory import sentencepiece_tokenizer, write_hf_model_gguf
    path = str(d / "tiny-gemma3.gguf")
    write_hf_model_gguf(path, hf, "gemma3", tokenizer=sentencepiece_tokenizer(GEMMA_TEMPLATE))
    hf_dir = d / "hf"
    hf.save_pretrained(hf_dir)
    Tokenizer.from_gguf(path).hf_tokenizer.save_pretrained(hf_dir)
    return path, str(hf_dir)


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    """(HF model, its GGUF, an HF directory of it with the GGUF's tokenizer)."""
    hf = gguf_shaped_hf()
    path, hf_dir = gemma_files_in(tmp_path_factory.mktemp("gemma3"), hf)
    return hf, path, hf_dir


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_factory_gguf_reads_back_in_transformers(gemma_files):
    """The file is written as llama.cpp would (norms as 1 + w): transformers' own GGUF reader
    rebuilds the same model, so the factory is a fair stand-in for real files."""
    from tests.helpers.hf_oracle import load_hf_gguf
    hf, path, _ = gemma_files
    ids = torch.randint(0, hf.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(load_hf_gguf(path)(ids).logits, hf(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_engine_greedy_matches_hf(gemma_files, fmt):
    """Three schedules (one batch; chunked prefill; a KV pool that preempts) against HF; the
    prompts run far past the window of 8."""
    from tests.helpers.engine_vs_hf import check_engine_matches_hf
    hf, path, hf_dir = gemma_files
    check_engine_matches_hf(path if fmt == "gguf" else hf_dir, hf, f"gemma3-{fmt}",
                            vocab_size=hf.config.vocab_size)


def test_engine_same_tokens_with_kernels_off(gemma_files, monkeypatch):
    """Gemma 3 decodes in the compiled decode stack; turning every compiled kernel off (the
    stack, attention, linear, rotary: the Python layers alone) changes no token."""
    from kvforge import LLM, SamplingParams
    from kvforge import kernels
    hf, path, _ = gemma_files
    prompts = [[5, 9, 90, 17] * 5, [40] * 13]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    on = LLM(path, block_size=4, num_kv_blocks=64)
    assert on.engine.runner.model.decode_stack() is not None
    with_kernels = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(kernels, "_module", None)
    off = LLM(path, block_size=4, num_kv_blocks=64)
    assert off.engine.runner.model.decode_stack() is None
    without = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert with_kernels == without


@pytest.mark.parametrize("fmt", ["gguf", "hf", "int8"])
def test_decode_stack_matches_python_layers(gemma_files, fmt):
    """One decode step of a batch through the compiled stack (q/k norms, post norms,
    gelu-tanh, the local layers' window of 8 and RoPE base) against the Python layers on the
    same cache: hidden states to float rounding. Rows from 3 to 30 tokens: inside and past the
    window; then multi-step decoding (``decode_steps``) against one-step greedy where the stack
    runs every projection itself."""
    from kvforge import LLM
    from kvforge.attention.metadata import AttentionMetadata
    from kvforge.kernels import cpu_kernels
    if cpu_kernels() is None:
        pytest.skip("compiled kernels unavailable")
    hf, path, hf_dir = gemma_files
    # int8: projections the stack calls back as Python modules (its op-by-op path)
    llm = LLM(path if fmt == "gguf" else hf_dir, block_size=4, num_kv_blocks=64,
              quantization="int8" if fmt == "int8" else "auto")
    model = llm.engine.runner.model
    stack = model.decode_stack()
    assert stack is not None and stack.window == hf.config.sliding_window
    g = torch.Generator().manual_seed(11)
    lens = [3, 9, 30]
    kv_caches = [torch.randn(2, 64, 4, model.config.num_key_value_heads, model.config.head_dim,
                             generator=g) for _ in range(model.num_layers)]
    tables = [[i * 8 + b for b in range(8)] for i in range(3)]
    ids = torch.tensor([7, 11, 13])
    positions = torch.tensor([n - 1 for n in lens])
    meta = AttentionMetadata.build([1, 1, 1], [n - 1 for n in lens], tables, 4)
    with torch.inference_mode():
        compiled = model(ids, positions, [c.clone() for c in kv_caches], meta)
        model._decode_stack, model._decode_stack_built = None, True       # Python layers
        try:
            reference = model(ids, positions, [c.clone() for c in kv_caches], meta)
        finally:
            model._decode_stack = stack
    torch.testing.assert_close(compiled, reference, rtol=1e-4, atol=1e-4)
    if fmt == "int8":
        assert not model.can_decode_steps(3)
        return
    assert model.can_decode_steps(3)
    with torch.inference_mode():
        caches = [c.clone() for c in kv_caches]
        steps = model.decode_steps(ids, positions, 3, caches, torch.tensor(tables))
        one_step = []
        step_ids, caches = ids, [c.clone() for c in kv_caches]
        for s in range(3):
            m = AttentionMetadata.build([1, 1, 1], [n - 1 + s for n in lens], tables, 4)
            step_ids = model.compute_logits(model(step_ids, positions + s, caches, m)).argmax(-1)
            one_step.append(step_ids)
    assert torch.equal(steps, torch.stack(one_step, 1))


def test_quest_budget_covering_the_context_matches_hf(gemma_files):
    """``--sparse-attention quest``: the full layers take QUEST's backend, the sliding ones keep
    their window of 8 over QUEST's cache layout; with a budget above every context the decodes
    stay dense, and the three schedules (chunks, preemption) match HF."""
    from tests.helpers.engine_vs_hf import check_engine_matches_hf
    hf, path, _ = gemma_files
    check_engine_matches_hf(path, hf, "gemma3-quest", vocab_size=hf.config.vocab_size,
                            sparse_attention="quest", sparse_token_budget=4096)


def test_quest_sparse_decodes_on_the_full_layers_only(gemma_files, monkeypatch):
    """With a budget of 2 blocks, decodes past it read QUEST's top blocks in the full layer
    (layer 5 of 7: its index among the model's layers, so ``quest_dense_layers`` counts model
    layers), never in the sliding ones. The compiled stack runs them (QUEST's layout on every
    layer, the sliding layers' window over it) with the Python layers' tokens; the pool's
    blocks all come back."""
    from kvforge import LLM, SamplingParams
    from kvforge import kernels
    from kvforge.attention.quest import QuestAttentionBackend, WindowedQuestBackend
    _, path, _ = gemma_files
    llm = LLM(path, block_size=4, num_kv_blocks=96, sparse_attention="quest",
              sparse_token_budget=8)
    model = llm.engine.runner.model
    attns = [layer.self_attn.attn for layer in model.model.layers]
    kinds = [type(a) for a in attns]
    assert kinds == [QuestAttentionBackend if t == F else WindowedQuestBackend
                     for t in model.options.layer_types]
    assert [a.layer_idx for a in attns if isinstance(a, QuestAttentionBackend)] == [5]
    assert all(a.window.window == 8 for a in attns if isinstance(a, WindowedQuestBackend))
    stack = model.decode_stack()
    assert (stack is not None and stack.quest) or kernels.cpu_kernels() is None
    from tests.helpers.engine_watch import spy_quest_sparse_decodes
    sparse_layers = spy_quest_sparse_decodes(monkeypatch)
    prompts = [[5, 9, 90, 17] * 6, list(range(3, 60, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert sparse_layers == [] or stack is None          # the stack took the decodes
    # the Python layers (no stack): the same tokens, sparse decodes in layer 5 only
    monkeypatch.setattr(model, "_decode_stack", None)
    monkeypatch.setattr(llm.engine.runner, "_stack_limit", None)
    python = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in python] == [o.outputs[0].token_ids for o in outs]
    assert sparse_layers and set(sparse_layers) == {5}
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks


def test_streaming_llm_windows_the_full_layers(gemma_files, monkeypatch):
    """``--attention-sinks 2 --sliding-window 16``: the full layer takes StreamingLLM's window
    (in-cache positions, global RoPE), the sliding ones keep their own window of 8; the blocks
    outside sinks + 16 are freed (a decoding request holds at most 6 blocks of 4), and the
    compiled stack (two windows: 8, and 16 with sinks) gives the Python layers' tokens and
    logprobs. A window narrower than the model's own is refused."""
    from kvforge import LLM, SamplingParams
    from kvforge import kernels
    from kvforge.attention.window import AttentionWindow
    from tests.helpers.engine_watch import run_and_watch
    _, path, _ = gemma_files
    llm = LLM(path, block_size=4, num_kv_blocks=64, attention_sinks=2, sliding_window=16)
    model = llm.engine.runner.model
    windows = [layer.self_attn.attn.window for layer in model.model.layers]
    assert windows == [AttentionWindow(2, 16, "in_cache") if t == F else
                       AttentionWindow(0, 8, "true") for t in model.options.layer_types]
    stack = model.decode_stack()
    assert (stack is not None and stack.window == 16) or kernels.cpu_kernels() is None
    prompts = [[5, 9, 90, 17] * 10, list(range(3, 60, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    tokens, most_held, logprobs = run_and_watch(llm, prompts, params, decoding_only=True)
    assert all(len(t) == 48 for t in tokens)
    assert 0 < most_held <= 6                   # decoding: ceil(2 / 4) + ceil((3 + 15 + 1) / 4)
    monkeypatch.setattr(model, "_decode_stack", None)
    monkeypatch.setattr(llm.engine.runner, "_stack_limit", None)
    off = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [o.token_ids for o in off]
    for a, t, b in zip(logprobs, tokens, off):
        got = torch.tensor([lp[x] for lp, x in zip(a, t)])
        want = torch.tensor([lp[x] for lp, x in zip(b.logprobs, b.token_ids)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    with pytest.raises(ValueError, match="own sliding window"):
        LLM(path, block_size=4, num_kv_blocks=64, attention_sinks=2, sliding_window=6)


def test_ngram_speculation_through_the_stack_matches_plain_greedy(gemma_files):
    """Verification rows of speculated tokens run through the compiled stack, each query token
    with its own causal length and, on the local layers, its own window of 8: prompts that
    repeat themselves (long n-gram matches) past the window decode to the same tokens as
    plain greedy decoding, and the n-gram guesses are used."""
    from kvforge import LLM, SamplingParams
    _, path, _ = gemma_files
    prompts = [[5, 9, 90, 17, 33, 61] * 6, [40, 41, 42] * 7 + [43]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, block_size=4, num_kv_blocks=96)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(path, block_size=4, num_kv_blocks=96, speculative_method="ngram",
               num_speculative_tokens=4)
    assert spec.engine.runner.model.decode_stack() is not None
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = spec.engine.spec_stats
    assert stats.num_verify_steps > 0 and stats.num_accepted > 0
    spec.engine.check_integrity()


def test_gguf_tokenizer_and_chat_template(gemma_files):
    """SentencePiece vocabulary from the file: BOS added, pieces as the merges rank them, the
    chat template from tokenizer.chat_template and <end_of_turn> a stop token."""
    from kvforge.loader import load_model_source
    _, path, _ = gemma_files
    tok = load_model_source(path).load_tokenizer()
    ids = tok.encode("hello world")
    assert ids[0] == 2 and tok.decode(ids) == "hello world"
    assert tok.convert_ids_to_tokens(ids[1:]) == ["he", "ll", "o", "\u2581w", "o", "r", "ld"]
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert set(tok.eos_token_ids) == {1, 5}          # <eos>, <end_of_turn>


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_on_both_layer_kinds(gemma_files, kv_dtype):
    """``--kv-cache-dtype fp8_*``: the local layers keep their window of 8 over fp8 storage, the
    global ones read fp8 too (a quarter of fp32's bytes), decodes in the compiled stack. Greedy
    tokens do not depend on the schedule (whole prompts vs chunks of 5) or on the stack (the
    Python layers over the same cache), and follow the fp32 cache's until a near tie (both
    tokens in the other run's top 5)."""
    from kvforge import LLM, SamplingParams
    from kvforge import kernels
    from kvforge.attention.paged import PagedAttentionBackend
    from kvforge.quant.fp8_kv import KV_CACHE_DTYPES, FP8KVCache
    from tests.quant.test_fp8_kv import assert_tokens_follow_until_a_near_tie
    _, path, _ = gemma_files
    prompts = [[5, 9, 90, 17] * 5, [40] * 13, list(range(3, 60, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)

    def run(llm=None, **kw):
        llm = llm or LLM(path, block_size=4, num_kv_blocks=96, **kw)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
        return llm, outs

    llm, fp8 = run(kv_cache_dtype=kv_dtype)
    model = llm.engine.runner.model
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert all(isinstance(a, FP8KVCache) for a in attns)
    assert [isinstance(a, WindowedAttentionBackend) for a in attns] == \
        [t == S for t in model.options.layer_types]
    assert all(isinstance(a, PagedAttentionBackend) for a in attns)
    assert all(c.dtype == KV_CACHE_DTYPES[kv_dtype] for c in llm.engine.runner.kv_caches)
    assert model.decode_stack() is not None or kernels.cpu_kernels() is None
    _, chunked = run(kv_cache_dtype=kv_dtype, max_num_batched_tokens=5, max_num_seqs=2)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in fp8]
    model._decode_stack = None                           # the Python layers from here on
    _, python_layers = run(llm)
    assert [o.token_ids for o in python_layers] == [o.token_ids for o in fp8]
    _, ref = run()
    assert_tokens_follow_until_a_near_tie(fp8, ref)
