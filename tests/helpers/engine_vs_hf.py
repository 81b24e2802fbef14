"""Run a tiny HF model through the whole engine in the three schedules that stress it and check
greedy output against HF transformers: one batch, small token budget (chunked prefill), and a
KV pool too small for the batch (recompute preemption)."""
from __future__ import annotations

import random

from kvforge import LLM, SamplingParams
from tests.helpers.hf_oracle import check_greedy_close, hf_greedy

PROMPT_LENGTHS = (5, 33, 18, 47)
MAX_TOKENS = 12
BLOCK_SIZE = 4
# the longest request needs (47 + 12) / 4 = 15 blocks: a pool of 20 holds only one of the long ones
SCHEDULES = {
    "batched": dict(num_kv_blocks=128),
    "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=8, max_num_seqs=3),
    "preempting": dict(num_kv_blocks=20),
}


def random_prompts(seed: int, vocab_size: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def check_engine_matches_hf(path: str, hf_model, name: str, seed: int = 0,
                            vocab_size: int = 49152, **engine_kwargs) -> None:
    prompts = random_prompts(seed, vocab_size)
    refs = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=4)
    for schedule, kwargs in SCHEDULES.items():
        llm = LLM(path, block_size=BLOCK_SIZE, **kwargs, **engine_kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out, (hf_tokens, hf_lps) in zip(prompts, outs, refs):
            ours = out.outputs[0]
            check_greedy_close(ours.token_ids, ours.logprobs, hf_tokens, hf_lps,
                               name=f"{name}/{schedule} len={len(prompt)}")
        if schedule == "preempting":
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "pool meant to preempt"
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
