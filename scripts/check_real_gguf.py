"""Agreement of kvforge (dequantized fp32, ``--quantization none``) with HF transformers on a
real GGUF file: teacher-forced top-1 over a text, greedy tokens after a chat prompt.

    python scripts/check_real_gguf.py PATH.gguf [--tokens 256] [--greedy 32]

Both sides dequantize the same file to fp32 (transformers via ``gguf_file=``), so differences
are float summation order only; a near-tie may flip a greedy token and then the texts diverge.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.helpers

TEXT = '''def merge_sort(items):
    """Sort a list with merge sort and return a new list."""
    if len(items) <= 1:
        return list(items)
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged


class LRUCache:
    """A least-recently-used cache with a fixed capacity."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value
'''


def kvforge_logits(model, tokens: list[int]) -> torch.Tensor:
    from kvforge.attention.metadata import AttentionMetadata
    block = 16
    blocks = -(-len(tokens) // block)
    caches = [torch.zeros(model.kv_cache_shape(blocks, block), dtype=model.kv_cache_dtype())
              for _ in range(model.num_layers)]
    meta = AttentionMetadata.build([len(tokens)], [0], [list(range(blocks))], block)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), meta.positions(), caches, meta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    # past 512 tokens so that Gemma 3's sliding windows (512) matter
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--greedy", type=int, default=32)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from kvforge import LLM, SamplingParams
    from kvforge.loader import load_model_source
    from kvforge.quant.loading import load_model
    from tests.helpers.hf_oracle import check_greedy_close, hf_greedy

    t0 = time.time()
    source = load_model_source(args.path)
    tokenizer = source.load_tokenizer()
    tokens = tokenizer.encode(TEXT * 4)[: args.tokens]
    model = load_model(source)
    ours = kvforge_logits(model, tokens)
    del model
    print(f"kvforge: {source.config.architecture}, {len(tokens)} tokens ({time.time() - t0:.0f} s)")
    t0 = time.time()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.path),
                                              gguf_file=os.path.basename(args.path),
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    print(f"transformers: {type(hf).__name__} ({time.time() - t0:.0f} s)")
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    diff = (ours - ref).abs().max().item()
    print(f"teacher-forced top-1 agreement: {agree:.4f} over {len(tokens)} positions; "
          f"max |logit diff| {diff:.2e} (logit scale {ref.abs().max().item():.1f})")

    request = "Write a Python function that reverses a string."
    # a base model's file may have no chat template: then the plain text
    chat = (tokenizer.apply_chat_template([{"role": "user", "content": request}])
            if tokenizer.chat_template else tokenizer.encode(request + "\n"))
    # fp32 like the teacher-forced part (the native blocks' int8 activations round otherwise)
    llm = LLM(args.path, max_model_len=1024, kv_cache_memory="256MiB", quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=args.greedy, ignore_eos=True, logprobs=5)
    out = llm.generate([chat], params, use_tqdm=False)[0].outputs[0]
    hf_tokens, hf_lps = hf_greedy(hf, chat, args.greedy)
    same = check_greedy_close(out.token_ids, out.logprobs, hf_tokens, hf_lps, name="greedy")
    equal = sum(a == b for a, b in zip(out.token_ids, hf_tokens))
    print(f"greedy: {same} of {args.greedy} tokens before any divergence "
          f"({equal} positions equal); kvforge text: {tokenizer.decode(out.token_ids)!r}")


if __name__ == "__main__":
    main()
