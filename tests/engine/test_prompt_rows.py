"""A prompt's rows are computed one way however the prompt arrives (layers/prompt_rows.py): whole,
after a prefix-cache hit (a few tail rows), or in chunked-prefill pieces with a short last one.

On GGUF weights the projections leave their integer dots for int8 panels from a measured row
count on (set here to 16, panels; the test suite's default is never), and the two round
activations differently: computed by row count, a prefix hit's 8-row tail would run the dots
(in the compiled decode stack) where the whole 40-token prompt runs panels, which moves the
logprobs and, at near-ties, the greedy tokens. The default model's logprobs are compared as
exact floats."""
import pytest

from kvforge import LLM, SamplingParams

PROMPT = list(range(700, 740))          # 40 tokens: 2 full blocks of 16, then 8


def generate(llm, prompt=PROMPT):
    """Greedy tokens and logprobs of ``prompt``, and how the steps split its prompt: a list of
    (tokens already computed, tokens this step) per step that prefilled some of it."""
    engine = llm.engine
    schedule, pieces = engine.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        for req in out.scheduled:
            if req.num_computed_tokens < req.num_prompt_tokens:
                pieces.append((req.num_computed_tokens,
                               min(out.num_query_tokens(req.request_id),
                                   req.num_prompt_tokens - req.num_computed_tokens)))
        return out

    engine.scheduler.schedule = recording_schedule
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True, logprobs=1),
                           use_tqdm=False)[0].outputs[0]
    finally:
        engine.scheduler.schedule = schedule
    engine.check_integrity()
    return out.token_ids, out.logprobs, pieces


@pytest.fixture
def on_panels(monkeypatch):
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_ROWS", "16")
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_KERNEL", "panels")


def test_a_prefix_hit_computes_the_prompt_tail_as_the_whole_prompt(default_model_path, on_panels):
    llm = LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=256)
    assert llm.engine.runner._many_row_kernels, "GGUF projections should leave the dots at 16"
    tokens, logprobs, pieces = generate(llm)
    assert pieces == [(0, 40)]
    again_tokens, again_logprobs, pieces = generate(llm)
    assert pieces == [(32, 8)], "the second run should reuse two cached blocks"
    assert again_tokens == tokens
    assert again_logprobs == logprobs                   # exact floats


def test_chunked_prefill_pieces_compute_the_prompt_as_one(default_model_path, on_panels):
    whole = generate(LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=256,
                         enable_prefix_caching=False))
    chunked = generate(LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=256,
                           enable_prefix_caching=False, enable_chunked_prefill=True,
                           max_num_batched_tokens=18))
    assert whole[2] == [(0, 40)]
    assert chunked[2] == [(0, 18), (18, 18), (36, 4)]   # the last piece: 4 rows
    assert chunked[:2] == whole[:2]


def test_without_many_row_kernels_prompts_still_skip_the_decode_stack(default_model_path):
    """The suite's default (no crossover): every projection runs its dots, and a short prompt
    tail takes the Python layers' dots as the whole prompt did, not the stack's (whose norms
    and attention round otherwise)."""
    llm = LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=256)
    assert not llm.engine.runner._many_row_kernels
    tokens, logprobs, _ = generate(llm)
    again_tokens, again_logprobs, pieces = generate(llm)
    assert pieces == [(32, 8)]
    assert (again_tokens, again_logprobs) == (tokens, logprobs)


@pytest.fixture(scope="module")
def tiny_gemma3_q4_1(tmp_path_factory):
    """A tiny Gemma 3 GGUF (sliding window 8 on 6 of its 7 layers) whose projections are Q4_1
    blocks, as the default model's: a windowed attention layer's prompt rows too."""
    from gguf import GGMLQuantizationType as QT, quants
    from tests.loader.gguf_factory import sentencepiece_tokenizer, write_hf_model_gguf
    from tests.models.test_gemma3 import GEMMA_TEMPLATE, gguf_shaped_hf

    def q4_1(name, arr):
        if arr.ndim != 2 or name.startswith("token_embd"):
            return arr, QT.F32
        return quants.quantize(arr, QT.Q4_1), QT.Q4_1
    path = str(tmp_path_factory.mktemp("gemma3_q4_1") / "tiny-gemma3-q4_1.gguf")
    write_hf_model_gguf(path, gguf_shaped_hf(), "gemma3",
                        tokenizer=sentencepiece_tokenizer(GEMMA_TEMPLATE), encode=q4_1)
    return path


def test_gemma3_windowed_prompt_rows_round_alike_in_any_split(tiny_gemma3_q4_1, on_panels):
    """Whole, after a prefix hit, and in chunks of 18 (a last one of 4): the same logprobs to
    the bit, the local layers' window (8) tiled as the global layers' full attention."""
    prompt = [5 + i % 40 for i in range(40)]
    common = dict(num_kv_blocks=64, block_size=16, max_model_len=128)
    whole = LLM(tiny_gemma3_q4_1, enable_prefix_caching=False, **common)
    assert whole.engine.runner._many_row_kernels
    tokens, logprobs, pieces = generate(whole, prompt)
    assert pieces == [(0, 40)]
    cached = LLM(tiny_gemma3_q4_1, **common)
    generate(cached, prompt)
    assert generate(cached, prompt) == (tokens, logprobs, [(32, 8)])
    chunked = LLM(tiny_gemma3_q4_1, enable_prefix_caching=False, enable_chunked_prefill=True,
                  max_num_batched_tokens=18, **common)
    assert generate(chunked, prompt) == (tokens, logprobs, [(0, 18), (18, 18), (36, 4)])
