"""Sampler: distributions (chi-square), greedy, penalties, seeds, min_tokens, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from kvforge.engine.request import Request
from kvforge.layers.sampler import (Sampler, SamplingBatch, apply_penalties,
                                    compute_prompt_logprobs)
from kvforge.sampling_params import SamplingParams

torch.set_num_threads(1)

EOS = 2
# 8-token vocabulary with distinct logits (no ties at any top-k / top-p / min-p boundary)
LOGITS8 = [1.0, 0.2, 2.1, -0.5, 1.6, 0.9, -1.3, 0.4]


def make_request(i: int = 0, prompt=(5, 6, 7), outputs=(), **params) -> Request:
    req = Request(f"r{i}", list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))
    for t in outputs:
        req.append_output_token(t)
    return req


def sample(requests: list[Request], logits: torch.Tensor):
    return Sampler()(logits, SamplingBatch.from_requests(requests, logits.shape[1]))


# ---- plain-Python reference distributions ---------------------------------------------------

def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def reference_probs(logits: list[float], temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order if top_k < 0 else order[:top_k])
    probs = softmax([scaled[i] if i in keep else -math.inf for i in range(len(scaled))])
    mass, nucleus = 0.0, set()
    for i in order:
        if i in keep and mass < top_p:
            nucleus.add(i)
            mass += probs[i]
    probs = softmax([scaled[i] if i in nucleus else -math.inf for i in range(len(scaled))])
    top = max(probs)
    return softmax([scaled[i] if probs[i] >= min_p * top and probs[i] > 0 else -math.inf
                    for i in range(len(scaled))])


CASES = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.3, top_k=5, top_p=0.8),
    dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.1),
]


def assert_matches(counts: list[int], expected: list[float]) -> None:
    n = sum(counts)
    for c, p in zip(counts, expected):
        if p == 0.0:
            assert c == 0, (counts, expected)
    kept = [i for i, p in enumerate(expected) if p > 0]
    if len(kept) > 1:
        p_value = chisquare([counts[i] for i in kept], [expected[i] * n for i in kept]).pvalue
        assert p_value > 1e-4, (counts, [round(p * n) for p in expected], p_value)


def test_reference_probs_masks_what_the_rules_say():
    # the reference itself, on numbers checked by hand: top-2 of [3, 1, 2] keeps ids 0 and 2
    assert reference_probs([3.0, 1.0, 2.0], top_k=2)[1] == 0.0
    # p = [.665, .245, .090]; top_p .7 needs ids 0 and 1
    p = reference_probs([3.0, 2.0, 1.0], top_p=0.7)
    assert p[2] == 0.0 and p[1] > 0.0
    # min_p .3: .090 < .3 * .665
    assert reference_probs([3.0, 2.0, 1.0], min_p=0.3)[2] == 0.0


def test_mixed_batch_matches_each_rows_distribution():
    """One batch, six parameter sets interleaved row by row: each group has its own law."""
    torch.manual_seed(0)
    per_case = 6000
    requests = [make_request(i, **CASES[i % len(CASES)]) for i in range(per_case * len(CASES))]
    logits = torch.tensor([LOGITS8] * len(requests))
    tokens = sample(requests, logits).sampled_token_ids
    for c, case in enumerate(CASES):
        counts = torch.bincount(tokens[c::len(CASES)], minlength=8).tolist()
        assert_matches(counts, reference_probs(LOGITS8, **case))


def test_top_k_candidate_path_when_every_row_limits_k():
    """All rows set top_k <= V/2, so only the top max(k) candidates are sorted."""
    torch.manual_seed(6)
    logits16 = LOGITS8 + [-20.0 + i for i in range(8)]
    cases = [dict(top_k=3), dict(top_k=6, top_p=0.8, temperature=1.4), dict(top_k=5, min_p=0.2),
             dict(temperature=0.0)]
    requests = [make_request(i, **cases[i % 4]) for i in range(4 * 5000)]
    tokens = sample(requests, torch.tensor([logits16] * len(requests))).sampled_token_ids
    assert set(tokens[3::4].tolist()) == {2}
    for c, case in enumerate(cases[:3]):
        assert_matches(torch.bincount(tokens[c::4], minlength=16).tolist(),
                       reference_probs(logits16, **case))


def test_seeded_rows_follow_the_distribution_too():
    requests = [make_request(i, seed=1000 + i, temperature=0.8, top_k=6) for i in range(3000)]
    tokens = sample(requests, torch.tensor([LOGITS8] * len(requests))).sampled_token_ids
    assert_matches(torch.bincount(tokens, minlength=8).tolist(),
                   reference_probs(LOGITS8, temperature=0.8, top_k=6))


def test_tiny_top_p_keeps_the_most_likely_token():
    requests = [make_request(i, top_p=1e-6) for i in range(200)]
    tokens = sample(requests, torch.tensor([LOGITS8] * 200)).sampled_token_ids
    assert tokens.tolist() == [2] * 200


def test_greedy_is_argmax_and_ignores_sampling_knobs():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    requests = [make_request(i, temperature=0.0, top_k=3, top_p=0.5, seed=i) for i in range(6)]
    assert sample(requests, logits).sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    # greedy does not draw from a seeded request's generator
    assert requests[0].generator.get_state().equal(torch.Generator().manual_seed(0).get_state())


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    torch.manual_seed(2)
    logits = torch.randn(8, 50)
    requests = [make_request(i, temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    out = sample(requests, logits).sampled_token_ids
    assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def test_penalties_match_a_hand_computed_example():
    logits = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    prompt, outputs = [0, 1], [2, 2, 4]
    rep, freq, pres = 2.0, 0.5, 0.25
    # plain-Python rules: repetition over prompt + output, then OpenAI penalties over outputs
    expected = list(logits)
    for t in set(prompt + outputs):
        expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
    for t in set(outputs):
        expected[t] -= freq * outputs.count(t) + pres
    assert expected == [1.0, -2.0, -1.0, 3.0, -4.75, 1.0]

    penalised = make_request(0, prompt, outputs, repetition_penalty=rep, frequency_penalty=freq,
                             presence_penalty=pres)
    plain = make_request(1, prompt, outputs)
    batch = SamplingBatch.from_requests([penalised, plain], 6)
    got = apply_penalties(torch.tensor([logits, logits]), batch)
    assert got[0].tolist() == pytest.approx(expected)
    assert got[1].tolist() == logits


def test_presence_penalty_can_flip_the_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.0]])
    assert sample([make_request(0, outputs=[1], temperature=0.0)], logits).sampled_token_ids == 1
    flipped = make_request(0, outputs=[1], temperature=0.0, presence_penalty=0.2)
    assert sample([flipped], logits).sampled_token_ids == 2


def test_repetition_penalty_ignores_unseen_tokens_and_counts_the_prompt():
    logits = torch.tensor([[0.0, 4.0, 3.0, 0.0]])
    # token 1 only in the prompt: still penalised (4 / 2 = 2 < 3)
    req = make_request(0, prompt=[1], temperature=0.0, repetition_penalty=2.0)
    assert sample([req], logits).sampled_token_ids == 2


def test_seeded_request_is_reproducible_whatever_the_batch():
    torch.manual_seed(3)
    vocab = 64
    row = torch.randn(vocab) * 0.5   # flat enough that samples vary

    def run(position: int, others: list[Request], steps: int = 6) -> list[int]:
        target = make_request(99, seed=1234, temperature=1.1, top_p=0.95)
        for _ in range(steps):
            batch = list(others)
            batch.insert(position, target)
            logits = torch.randn(len(batch), vocab)
            logits[position] = row
            tok = sample(batch, logits).sampled_token_ids[position].item()
            target.append_output_token(tok)
            torch.manual_seed(tok)   # perturb the global RNG between steps
        return target.output_token_ids

    alone = run(0, [])
    assert len(set(alone)) > 1
    mixed = [make_request(1), make_request(2, seed=7), make_request(3, temperature=0.0),
             make_request(4, seed=8, top_k=5)]
    assert run(2, mixed) == alone
    assert run(4, mixed) == alone
    # a different seed gives a different sequence (so the equality above means something)
    other = make_request(5, seed=4321, temperature=1.1, top_p=0.95)
    toks = []
    for _ in range(6):
        toks.append(sample([other], row.unsqueeze(0)).sampled_token_ids.item())
        other.append_output_token(toks[-1])
    assert toks != alone


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]])   # EOS=2 best, then 3, then 4
    greedy = dict(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert sample([make_request(0, **greedy)], logits).sampled_token_ids == 4
    # ignore_eos: EOS may be sampled, stop_token_ids are still held back
    assert sample([make_request(0, ignore_eos=True, **greedy)], logits).sampled_token_ids == 2
    # min_tokens reached: nothing is masked
    assert sample([make_request(0, outputs=[0, 1], **greedy)], logits).sampled_token_ids == 2
    # random rows never draw a masked token either
    rand = [make_request(i, min_tokens=1, stop_token_ids=[3]) for i in range(300)]
    out = sample(rand, logits.repeat(300, 1)).sampled_token_ids
    assert set(out.tolist()) <= {0, 1, 4}


def test_logprobs_are_raw_log_softmax_with_true_top_k():
    torch.manual_seed(4)
    logits = torch.randn(3, 40)
    requests = [make_request(0, logprobs=3, repetition_penalty=1.5, outputs=[7]),
                make_request(1),
                make_request(2, logprobs=0, temperature=0.0)]
    out = sample(requests, logits)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (3, 4) and out.logprob_token_ids.shape == (3, 4)
    for i in (0, 2):
        chosen = out.sampled_token_ids[i].item()
        assert out.logprob_token_ids[i, 0].item() == chosen
        assert out.logprobs[i, 0].item() == pytest.approx(raw[i, chosen].item(), abs=1e-6)
        true_top = sorted(range(40), key=lambda t: -logits[i, t].item())[:3]
        assert out.logprob_token_ids[i, 1:].tolist() == true_top
        assert out.logprobs[i, 1:].tolist() == pytest.approx(raw[i, true_top].tolist(), abs=1e-6)
        assert out.logprob_ranks[i].item() == 1 + sum(
            logits[i, t].item() > logits[i, chosen].item() for t in range(40))
    assert out.logprob_ranks[2].item() == 1   # greedy picks the top token
    assert out.logprobs_dict(2, 0) == {out.sampled_token_ids[2].item(): out.logprobs[2, 0].item()}


def test_no_logprobs_requested_gives_none():
    out = sample([make_request(0)], torch.zeros(1, 8))
    assert out.logprobs is None and out.logprob_token_ids is None


def test_compute_prompt_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(4, 30)
    targets = torch.tensor([3, 0, 29, 11])
    lp, ids = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert ids[:, 0].tolist() == targets.tolist()
    for n in range(4):
        assert lp[n, 0].item() == pytest.approx(raw[n, targets[n]].item(), abs=1e-6)
        assert set(ids[n, 1:].tolist()) == set(raw[n].topk(2).indices.tolist())
    with pytest.raises(ValueError, match="next_token_ids"):
        compute_prompt_logprobs(logits, targets[:2], 2)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        SamplingBatch.from_requests([], 8)
    with pytest.raises(ValueError, match="out of range"):
        SamplingBatch.from_requests([make_request(0, prompt=[100], repetition_penalty=1.2)], 8)
    batch = SamplingBatch.from_requests([make_request(0)], 8)
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(1, 9), batch)


def test_flags_skip_stages_only_when_safe():
    batch = SamplingBatch.from_requests(
        [make_request(0, temperature=0.0, top_k=3), make_request(1, top_p=0.9)], 8)
    assert batch.no_top_k and not batch.no_top_p and batch.no_penalties
    assert not batch.all_greedy and not batch.all_random
    assert batch.temperature.tolist() == [1.0, 1.0]


def test_logit_bias_moves_greedy_and_sampling_but_not_raw_logprobs():
    """OpenAI's logit_bias is added to the logits before greedy's argmax and before sampling;
    the logprobs a request asks for stay the model's raw ones."""
    logits = torch.tensor([LOGITS8, LOGITS8])
    reqs = [make_request(0, temperature=0.0, logit_bias={2: -100.0}, logprobs=1),  # bans 2
            make_request(1, temperature=0.0, logit_bias={6: 100.0})]              # forces 6
    out = sample(reqs, logits)
    assert out.sampled_token_ids.tolist() == [4, 6]       # 2 is the plain argmax, 4 the next
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs_dict(0, 1) == pytest.approx({4: float(raw[4]), 2: float(raw[2])})
    # a random row: a -100 bias leaves the token's probability ~e^-100 of what it was
    g = [make_request(i, temperature=1.0, seed=i, logit_bias={2: -100.0, 4: -100.0})
         for i in range(200)]
    drawn = sample(g, torch.tensor([LOGITS8] * 200)).sampled_token_ids.tolist()
    assert 2 not in drawn and 4 not in drawn and len(set(drawn)) > 2


@pytest.mark.parametrize("bias, message", [({-1: 1.0}, "keys must be token ids"),
                                           ({3: 100.5}, r"values must be numbers in \[-100, 100\]"),
                                           ({True: 1.0}, "keys must be token ids"),
                                           ([1, 2], "must map token ids")])
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
