"""Speculative sampling is lossless: with n-gram proposals, or a draft model's sampled
proposals, verified by rejection sampling, the sampled tokens follow the target model's
distribution (chi-square against exact probabilities from HF transformers on a
small-vocabulary random model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from tests.helpers.chi_square import chi_square_p_value, expected_counts

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
            # float64: the expectations must sum to the sample count (tests/helpers/chi_square.py)
            logits = hf_model(ids).logits[:, -1].double() / temperature
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, -1).tolist()
            joint = {p + (t,): joint[p] * probs[i][t] for i, p in enumerate(prefixes)
                     for t in range(VOCAB)}
    return joint


TEMPERATURE, TOP_K = 0.8, 4
TINY = dict(vocab_size=VOCAB, num_hidden_layers=2, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _sample_triples(llm, prompt: list[int]) -> list[tuple[int, ...]]:
    """NUM_SAMPLES seeded samples of NUM_OUT tokens, all speculating in one batch."""
    spec = llm.engine.spec
    spec.min_acceptance = 0.0
    spec.disable_batch_size = NUM_SAMPLES     # speculate in a batch of all samples
    spec.max_verify_rows = None
    spec.guard = None                         # ... however slow its steps measure
    spec.cost = None                          # ... whatever the timed rows cost
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=NUM_OUT,
                             ignore_eos=True, seed=s) for s in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    stats = llm.engine.spec_stats
    # both branches ran: accepted proposals and rejected (resampled) ones
    assert 0 < stats.num_accepted < stats.num_proposed, stats
    triples = [tuple(o.outputs[0].token_ids) for o in outs]
    assert all(len(t) == NUM_OUT for t in triples)
    return triples


def _check_target_distribution(hf_model, prompt: list[int], triples: list[tuple]) -> None:
    joint = _exact_joint(hf_model, prompt, TEMPERATURE, TOP_K)
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = expected_counts([joint[c] for c in cells], NUM_SAMPLES)
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
    p_value = chi_square_p_value(obs_bins, exp_bins)
    assert p_value > 1e-3, (p_value, list(zip(obs_bins, exp_bins)))


@pytest.mark.slow
def test_ngram_rejection_sampling_matches_target_distribution(tiny_model_factory):
    path, hf_model = tiny_model_factory("llama", **TINY)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]          # repeats: the n-gram proposer always finds one
    llm = LLM(path, block_size=4, num_kv_blocks=4096, max_num_seqs=NUM_SAMPLES,
              max_num_batched_tokens=16384, speculative_method="ngram", num_speculative_tokens=2)
    _check_target_distribution(hf_model, prompt, _sample_triples(llm, prompt))


def _next_token_probs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].double() / TEMPERATURE
        logits[logits < logits.topk(TOP_K).values[-1]] = float("-inf")
        return torch.softmax(logits, -1)


@pytest.mark.slow
def test_draft_model_rejection_sampling_matches_target_distribution(tiny_model_factory):
    """A separate draft model that disagrees with the target (another random model): its
    sampled proposals and their probabilities q (spec/draft.py) go through the min(1, p/q)
    acceptance and the max(0, p - q) resampling, and the output still follows the target."""
    path, hf_model = tiny_model_factory("llama", **TINY)
    draft_path, hf_draft = tiny_model_factory("llama", **TINY, seed=1, initializer_range=0.2)
    prompt = [3, 4, 5, 2, 4]
    p, q = _next_token_probs(hf_model, prompt), _next_token_probs(hf_draft, prompt)
    assert 0.5 * float((p - q).abs().sum()) > 0.2, (p, q)    # total variation: they disagree
    llm = LLM(path, block_size=4, num_kv_blocks=4096, max_num_seqs=NUM_SAMPLES,
              max_num_batched_tokens=16384, speculative_method="draft",
              speculative_draft_model=draft_path, num_speculative_tokens=2,
              speculative_draft_ngram=False)
    llm.engine.spec.cost = None     # draft every step, whatever the measured costs say
    drafter = llm.engine.runner.drafter
    propose, num_q_rows = drafter.propose, []

    def counting_propose(sched, kv_caches):
        probs = propose(sched, kv_caches)
        num_q_rows.extend(len(rows) for rows in probs.values())
        return probs

    drafter.propose = counting_propose
    triples = _sample_triples(llm, prompt)
    # the draft's probabilities reached verification for every sampled proposal
    assert sum(num_q_rows) == llm.engine.spec_stats.num_proposed > 0
    _check_target_distribution(hf_model, prompt, triples)
