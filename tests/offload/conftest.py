"""What the offload tests compare with: greedy tokens of the same tiny model fully in memory."""
from __future__ import annotations

from kvforge import LLM


def greedy_in_memory(model_dir: str, prompts: list[str], params) -> list[list[int]]:
    llm = LLM(model_dir, quantization="none", kv_cache_memory="16MiB", max_model_len=128,
              max_num_batched_tokens=24, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
