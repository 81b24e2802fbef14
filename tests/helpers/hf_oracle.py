"""HF transformers as the correctness oracle: tiny random models and greedy references."""
from __future__ import annotations

import math
import os
import shutil

import torch

TINY_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build_tiny_model(kind: str, out_dir: str, tokenizer_dir: str, seed: int = 0, **overrides):
    """A random HF model of a given family, saved (sharded) with SmolLM2's tokenizer."""
    import transformers as tf
    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
               "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
               "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
               "gpt_bigcode": (tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM),
               "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
               "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}
    if kind not in classes:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    cfg_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    base = dict(TINY_BASE)
    if kind in ("gpt2", "gpt_bigcode"):
        # GPT-2 style configs have no such keys (MLP width is n_inner, K/V heads are implied);
        # left in, config.json would carry values the HF model ignores
        del base["intermediate_size"], base["num_key_value_heads"]
    config = cfg_cls(**{**base, **overrides})
    model = model_cls(config).eval()
    if kind == "gemma3":
        with torch.no_grad():            # HF starts Gemma's norms at 0 (scale 1): make them matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.5)
    # small shards so the sharded safetensors path (index json) is exercised
    model.save_pretrained(out_dir, max_shard_size="2MB")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    return model


def load_hf_gguf(path: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_k: int = 5):
    """Greedy decode with the HF model (no EOS stop). Returns (tokens, top-k logprob dicts)."""
    ids = torch.tensor([prompt_ids])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float(), -1)
        tok = int(torch.argmax(lp))
        vals, idx = torch.topk(lp, top_k)
        tokens.append(tok)
        logprobs.append({int(i): float(v) for i, v in zip(idx, vals)})
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return tokens, logprobs


def check_greedy_close(ours_tokens, ours_logprobs, hf_tokens, hf_logprobs, name="",
                       logprob_tol=5e-2):
    """vLLM-style: equal token for token; where float noise flips a near-tie, each side's token
    must be in the other's top-k at that position (then the sequences diverge: stop there).
    ``logprob_tol``: how far an equal token's logprob may be from HF's (float noise: 5e-2; a
    lossy path such as 8-bit activations states its own)."""
    assert len(ours_tokens) == len(hf_tokens), f"{name}: lengths {len(ours_tokens)} != {len(hf_tokens)}"
    for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)):
        if a == b:
            if ours_logprobs is not None:
                assert abs(ours_logprobs[i][a] - hf_logprobs[i][b]) < logprob_tol, \
                    f"{name}: logprob of token {a} at {i}: {ours_logprobs[i][a]} vs {hf_logprobs[i][b]}"
            continue
        assert ours_logprobs is not None, f"{name}: token {i} differs ({a} vs HF {b})"
        assert b in ours_logprobs[i] and a in hf_logprobs[i], (
            f"{name}: token {i} differs ({a} vs HF {b}) and is not a near-tie: "
            f"ours {ours_logprobs[i]}, HF {hf_logprobs[i]}")
        return i
    return len(ours_tokens)


@torch.inference_mode()
def hf_perplexity(model, token_ids: list[int], window: int) -> tuple[float, int]:
    """(exp(mean NLL), tokens scored) over non-overlapping windows, each scored from its own
    start: the quantity kvforge.eval.perplexity defines, computed by the HF model."""
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        ids = torch.tensor([token_ids[start:start + window]])
        if ids.shape[1] < 2:
            continue
        logits = model(ids).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count), count
