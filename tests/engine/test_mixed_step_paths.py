"""A step that mixes sequences on different paths (the compiled decode stack's decodes, prompt
rows in the Python layers) computes each sequence on its own path (ModelRunner._path_groups):
a request's numbers do not depend on what else shares its steps, bit for bit."""
import pytest

from kvforge import LLM, SamplingParams


def short_request_output(llm, joiner_prompt=None):
    """Greedy tokens and logprobs of a request with a 9-token prompt; ``joiner_prompt`` (if
    given) arrives with it, so both prompts are computed in the same step."""
    engine = llm.engine
    engine.add_request("a", list(range(500, 509)),
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                      logprobs=2))
    if joiner_prompt is not None:
        engine.add_request("b", joiner_prompt,
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    schedule, mixed = engine.scheduler.schedule, []

    def recording_schedule():
        out = schedule()
        if ({"a", "b"} <= set(out.num_scheduled_tokens) and out.num_query_tokens("a") == 9
                and out.num_query_tokens("b") > 16):
            mixed.append(out)
        return out

    engine.scheduler.schedule = recording_schedule
    out_a = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "a" and out.finished:
                out_a = out.outputs[0]
    engine.scheduler.schedule = schedule
    engine.check_integrity()
    return out_a.token_ids, out_a.logprobs, len(mixed)


def test_a_long_chunk_in_the_step_leaves_a_short_prompt_bit_identical(default_model_path):
    """On the default model's GGUF weights activations are quantized to 8 bits, which turns the
    two paths' rounding differences into other logprobs (and, at near-ties, other greedy
    tokens): a short prompt computed beside a long one used to take the long one's path."""
    llm = LLM(default_model_path, kv_cache_memory="64MiB", max_model_len=256,
              num_decode_steps=1, enable_prefix_caching=False)
    if llm.engine.runner._stack_query_limit is None:
        pytest.skip("no compiled decode stack here: every step takes one path")
    alone_tokens, alone_logprobs, _ = short_request_output(llm)
    # 40 prompt tokens: longer than the stack's query runs (Python layers)
    tokens, logprobs, mixed = short_request_output(llm, list(range(1000, 1040)))
    assert mixed == 1                          # both prompts in one step
    assert tokens == alone_tokens
    assert logprobs == alone_logprobs          # exact floats, not approximately
