"""verify_proposals: greedy acceptance rule, and the sampling rule's output distribution at one
position against the target's exact distribution (point-mass and general draft q)."""
import numpy as np
import torch

from tests.helpers.chi_square import chi_square_p_value

from kvforge.engine.request import Request
from kvforge.sampling_params import SamplingParams
from kvforge.spec.rejection import verify_proposals

V = 5


def _req(rid, temperature=0.0, seed=None):
    return Request(rid, [1, 2], SamplingParams(temperature=temperature, seed=seed, max_tokens=8))


def _onehot_logits(ids):
    logits = torch.full((len(ids), V), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_accepts_until_first_mismatch_then_target_token():
    reqs = [_req("a"), _req("b"), _req("c")]
    drafts = [[3, 4, 0], [2], [1, 1]]
    # target argmax rows: a: 3 4 2 | 0  (mismatch at 3rd), b: 2 | 4 (all accepted + bonus),
    # c: 0 | ... (first rejected)
    rows = [3, 4, 2, 0] + [2, 4] + [0, 1, 1]
    out = verify_proposals(_onehot_logits(rows), reqs, drafts)
    assert out == [[3, 4, 2], [2, 4], [0]]


def _draw(p_logits, draft, q=None, n=1500):
    counts = np.zeros(V)
    gen = torch.Generator().manual_seed(0)
    req = _req("r", temperature=1.0)
    req.generator = gen
    logits = torch.stack([p_logits, p_logits])         # row 0 checks the draft, row 1 = bonus
    for _ in range(n):
        out = verify_proposals(logits, [req], [[draft]], {"r": q[None]} if q is not None else None)
        counts[out[0][0]] += 1                             # the token emitted at the first position
    return counts


def test_point_mass_proposal_keeps_target_distribution():
    p_logits = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0])
    p = torch.softmax(p_logits.double(), 0).numpy()
    counts = _draw(p_logits, draft=3)
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-3, (counts, p * counts.sum())


def test_draft_distribution_proposal_keeps_target_distribution():
    p_logits = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0])
    p = torch.softmax(p_logits.double(), 0).numpy()
    q = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1])
    # the draft token is drawn from q, as a draft model would
    gen = torch.Generator().manual_seed(1)
    counts = np.zeros(V)
    req = _req("r", temperature=1.0)
    req.generator = torch.Generator().manual_seed(2)
    logits = torch.stack([p_logits, p_logits])
    for _ in range(1500):
        d = int(torch.multinomial(q, 1, generator=gen))
        out = verify_proposals(logits, [req], [[d]], {"r": q[None]})
        counts[out[0][0]] += 1
    p_value = chi_square_p_value(counts, p)
    assert p_value > 1e-3, (counts, p * counts.sum())


def test_wrong_row_count_is_rejected():
    import pytest
    with pytest.raises(ValueError, match="rows"):
        verify_proposals(torch.zeros(2, V), [_req("a")], [[1, 2]])
