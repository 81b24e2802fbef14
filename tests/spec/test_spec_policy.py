"""SpecDecoder's adaptive policy: the per-step row budget, shrinking k on rejection and growing
it back, and the acceptance pause (unit level, no model)."""
from __future__ import annotations

import pytest

from kvforge.engine.request import Request
from kvforge.sampling_params import SamplingParams
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import TokenProposer
from kvforge.spec.decoder import SpecDecoder


class Repeat(TokenProposer):
    """Proposes ``max_tokens`` copies of token 7."""

    def propose(self, token_ids, max_tokens):
        return [7] * max_tokens


def decoding(n: int) -> list[Request]:
    """n requests with their prompt computed and one sampled token left to feed (decoding)."""
    reqs = []
    for i in range(n):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100))
        req.append_output_token(4)
        req.num_computed_tokens = 3
        reqs.append(req)
    return reqs


def step(spec: SpecDecoder, reqs: list[Request], accepted: dict[str, int]) -> dict[str, int]:
    """Propose, then record ``accepted[rid]`` accepted drafts; returns the proposal lengths."""
    spec.before_schedule(reqs)
    sched = SchedulerOutput(spec_token_ids={r.request_id: list(r.spec_token_ids) for r in reqs})
    sampled = {r.request_id: [7] * accepted.get(r.request_id, 0) + [9] for r in reqs}
    spec.record(sched, sampled)
    return {rid: len(d) for rid, d in sched.spec_token_ids.items()}


@pytest.mark.parametrize("batch, k", [(1, 7), (2, 3), (3, 1), (4, 1), (5, 0), (8, 0)])
def test_row_budget_splits_what_is_left_after_the_decode_rows(batch, k):
    spec = SpecDecoder(7, Repeat(), 1000, max_verify_rows=8)
    lengths = step(spec, decoding(batch), {})
    assert set(lengths.values()) == {k}
    assert batch + sum(lengths.values()) <= 8


def test_no_row_budget_proposes_full_k_at_any_batch():
    spec = SpecDecoder(5, Repeat(), 1000, max_verify_rows=None)
    assert set(step(spec, decoding(6), {}).values()) == {5}


def test_rejection_halves_k_down_to_the_minimum_and_full_acceptance_restores_it():
    spec = SpecDecoder(8, Repeat(), 1000, min_acceptance=0.0)
    reqs = decoding(1)
    lengths = [step(spec, reqs, {})["r0"] for _ in range(4)]     # every draft rejected
    assert lengths == [8, 4, 2, 2]
    assert step(spec, reqs, {"r0": 1})["r0"] == 2                 # partly accepted: k stays
    assert step(spec, reqs, {"r0": 2})["r0"] == 2                 # all accepted
    assert step(spec, reqs, {})["r0"] == 8                        # back to the full k


def test_low_acceptance_pauses_with_backoff_unless_disabled():
    spec = SpecDecoder(4, Repeat(), 1000, min_acceptance=0.2)
    reqs = decoding(1)
    lengths = [step(spec, reqs, {}).get("r0", 0) for _ in range(8)]
    # EMA 1 -> .5 -> .25 -> .125 < .2 after the third rejection: 4 steps without proposals
    assert lengths[:3] == [4, 2, 2] and lengths[3:7] == [0, 0, 0, 0] and lengths[7] == 2
    never = SpecDecoder(4, Repeat(), 1000, min_acceptance=0.0)
    assert all(step(never, reqs, {}).get("r0", 0) > 0 for _ in range(8))


def test_bad_row_budget_raises():
    with pytest.raises(ValueError, match="max_verify_rows"):
        SpecDecoder(4, Repeat(), 1000, max_verify_rows=1)


def test_row_budget_follows_the_linear_kernel(monkeypatch):
    import torch

    from kvforge import kernels
    from kvforge.kernels import ops
    compiled = kernels.cpu_kernels()
    expected = None if compiled is None else compiled.linear_few_rows_max
    if expected is not None:
        assert ops.single_pass_rows(torch.device("cpu"), torch.float32) == expected in (4, 8)
    monkeypatch.setattr(kernels, "_module", None)               # no compiler: MKL alone
    assert ops.single_pass_rows(torch.device("cpu"), torch.float32) == 2
    assert ops.single_pass_rows(torch.device("cpu"), torch.bfloat16) is None
    assert ops.single_pass_rows(torch.device("meta"), torch.float32) is None
