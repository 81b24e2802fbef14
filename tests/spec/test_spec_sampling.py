"""Speculative sampling is lossless: with n-gram proposals verified by rejection sampling, the
sampled tokens follow the target model's distribution (chi-square against exact probabilities
from HF transformers on a small-vocabulary random model)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvforge import LLM, SamplingParams

VOCAB = 6
NUM_OUT = 3
NUM_SAMPLES = 1500


def _exact_joint(hf_model, prompt: list[int], temperature: float, top_k: int
                 ) -> dict[tuple, float]:
    """P(t1, t2, t3 | prompt) for every triple, from the HF model's logits (temperature, then
    top-k, as the sampler does)."""
    joint = {(): 1.0}
    with torch.inference_mode():
        for _ in range(NUM_OUT):
            prefixes = list(joint)
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = hf_model(ids).logits[:, -1].float() / temperature
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1).tolist()
            joint = {p + (t,): joint[p] * probs[i][t] for i, p in enumerate(prefixes)
                     for t in range(VOCAB)}
    return joint


@pytest.mark.slow
def test_ngram_rejection_sampling_matches_target_distribution(tiny_model_factory):
    path, hf_model = tiny_model_factory("llama", vocab_size=VOCAB, num_hidden_layers=2,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]          # repeats: the n-gram proposer always finds one
    temperature, top_k = 0.8, 4
    llm = LLM(path, block_size=4, num_kv_blocks=4096, max_num_seqs=NUM_SAMPLES,
              max_num_batched_tokens=16384, speculative_method="ngram", num_speculative_tokens=2)
    spec = llm.engine.spec
    spec.min_acceptance = 0.0
    spec.disable_batch_size = NUM_SAMPLES     # speculate in a batch of all samples
    spec.max_verify_rows = None
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=NUM_OUT,
                             ignore_eos=True, seed=s) for s in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks

    stats = llm.engine.spec_stats
    # both branches ran: accepted proposals and rejected (resampled) ones
    assert 0 < stats.num_accepted < stats.num_proposed, stats
    triples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == NUM_OUT for t in triples)

    joint = _exact_joint(hf_model, prompt, temperature, top_k)
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.array([joint[c] for c in cells]) * NUM_SAMPLES
    observed = np.array([sum(1 for t in triples if t == c) for c in cells], dtype=float)
    # top-k: a token outside a row's top-k is never emitted, proposed or not
    assert observed[expected == 0].sum() == 0
    # pool the rare cells (expected < 5) into one bin, as chi-square needs
    keep = expected >= 5
    rare = ~keep & (expected > 0)
    exp_bins, obs_bins = expected[keep], observed[keep]
    if rare.any():
        exp_bins = np.append(exp_bins, expected[rare].sum())
        obs_bins = np.append(obs_bins, observed[rare].sum())
    assert keep.sum() >= 10, "too few well-populated cells for a meaningful test"
    _, p_value = chisquare(obs_bins, exp_bins)
    assert p_value > 1e-3, (p_value, list(zip(obs_bins, exp_bins)))
