"""The speculation cost model (spec/cost.py) and the SpecDecoder policy it drives: k per request
from its acceptance, n-gram vs draft model, pausing where nothing pays (unit level, no model)."""
from __future__ import annotations

import pytest

from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import DRAFT_PLACEHOLDER, TokenProposer
from kvforge.spec.cost import ForwardCost, SpecCostModel, expected_tokens
from kvforge.spec.decoder import SpecDecoder
from kvforge.spec.draft import DraftStats
from tests.spec.test_spec_policy import Repeat, decoding

FREE_ROWS = ForwardCost(fixed=1.0, per_row=0.0)          # memory-bound: rows cost nothing
GGUF_ROWS = ForwardCost(fixed=0.6, per_row=0.4)          # measured shape of the 1.5B Q4_K_M


def test_forward_cost_through_two_timings_and_validation():
    cost = ForwardCost.from_points([(1, 0.10), (4, 0.22)])
    assert cost.per_row == pytest.approx(0.04) and cost.fixed == pytest.approx(0.06)
    assert cost(4) == pytest.approx(0.22)
    with pytest.raises(ValueError, match="per_row"):
        ForwardCost(fixed=1.0, per_row=-0.1)


def test_measured_points_bend_the_line():
    # the 1.5B's shape: rows up to 4 nearly hidden under the weights' reads, then ~0.28 each
    cost = ForwardCost.from_points([(1, 1.0), (2, 1.1), (4, 1.35), (8, 2.45)])
    assert cost(1) == pytest.approx(1.0) and cost(8) == pytest.approx(2.45)
    assert cost(3) == pytest.approx(1.225)                  # between 2 and 4
    assert cost(12) == pytest.approx(2.45 + 4 * 0.275)      # the last segment, extended
    assert cost.fixed == pytest.approx(0.9) and cost.per_row == pytest.approx(0.1)
    # a line through 1 and 4 rows (what two timings give) prices 8 rows far too low
    assert ForwardCost.from_points([(1, 1.0), (4, 1.35)])(8) < 0.75 * cost(8)
    # a point timed below the one before (noise) is taken as level with it
    noisy = ForwardCost.from_points([(1, 1.0), (2, 0.9), (4, 1.2)])
    assert noisy(2) == pytest.approx(1.0) and noisy(3) == pytest.approx(1.1)
    assert cost.scaled(2.0)(8) == pytest.approx(2.45 / 2)
    with pytest.raises(ValueError, match="points"):
        ForwardCost(1.0, 0.0, points=((2, 1.0), (1, 1.0)))


def test_bent_costs_choose_fewer_rows_than_the_straight_line():
    bent = SpecCostModel(ForwardCost.from_points([(1, 1.0), (2, 1.1), (4, 1.35), (8, 2.45)]))
    straight = SpecCostModel(ForwardCost.from_points([(1, 1.0), (4, 1.35)]))
    assert bent.best_k(0.8, 7) < straight.best_k(0.8, 7)
    # a batch of 2 proposing k = 3 verifies 8 rows: its share of that step
    assert bent.speedup(1.0, 3, batch=2) == pytest.approx(4 * (1.1 / 2) / (2.45 / 2))


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_free_rows_and_free_drafts_take_the_longest_proposal():
    model = SpecCostModel(FREE_ROWS)
    assert model.best_k(0.9, 7) == 7
    assert model.speedup(0.9, 7) == pytest.approx(expected_tokens(0.9, 7))


def test_costly_rows_choose_a_short_proposal_and_none_at_low_acceptance():
    model = SpecCostModel(GGUF_ROWS)
    k = model.best_k(0.9, 7)
    assert 1 <= k < 7
    assert model.speedup(0.9, k) > 1.0
    assert model.best_k(0.3, 7) == 0                   # 1.3 tokens for 1.4 step costs


def test_a_draft_model_costing_half_a_step_per_token_barely_pays_with_costly_rows():
    # the bound: even alpha = 1 emits k + 1 tokens for 1 + 0.4 k + 0.5 k < 1.11x
    model = SpecCostModel(GGUF_ROWS, ForwardCost(fixed=0.34, per_row=0.16))
    assert model.best(1.0, 7)[1] == pytest.approx(8 / (1 + 0.9 * 7))
    assert model.best_k(0.8, 7) == 0
    # ... while n-gram guesses (no draft forward) with the same rows still do
    assert model.best_k(1.0, 7, model_fraction=0.0) > 0


def test_larger_batches_shrink_k_until_nothing_pays():
    model = SpecCostModel(GGUF_ROWS)
    ks = [model.best_k(0.9, 7, batch=b) for b in (1, 2, 4, 8, 32)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] > 0 and ks[-1] == 0


class Copying(Repeat):
    """Repeat's guesses, each continuing a 12-token match of the context (a copied span: the
    longest match-length bucket, whose guesses start from a high prior)."""

    def propose_matched(self, token_ids, max_tokens):
        return self.propose(token_ids, max_tokens), 12


def _step(spec, reqs, accepted):
    spec.before_schedule(reqs)
    sched = SchedulerOutput(spec_token_ids={r.request_id: list(r.spec_token_ids) for r in reqs})
    sampled = {r.request_id: [7] * accepted + [9] for r in reqs}
    spec.record(sched, sampled)
    return sched.spec_token_ids


def test_decoder_k_follows_acceptance_and_pauses_then_probes():
    spec = SpecDecoder(7, Copying(), 1000, cost=SpecCostModel(GGUF_ROWS))
    reqs = decoding(1)
    lengths = [len(_step(spec, reqs, accepted=0).get("r0", [])) for _ in range(30)]
    assert lengths[0] > 0, "the prior acceptance must be worth a first proposal"
    # every draft rejected: proposals shrink, stop, and come back after ever longer pauses
    probes = [i for i in range(1, 30) if lengths[i] and not lengths[i - 1]]
    assert len(probes) >= 2, lengths
    gaps = [b - a for a, b in zip([0] + probes, probes)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], lengths
    assert lengths.count(0) > 30 // 2, lengths


def test_decoder_prefers_ngram_guesses_over_a_draft_model_that_costs_forwards():
    draft_cost = ForwardCost(fixed=0.05, per_row=0.05)
    spec = SpecDecoder(4, Copying(), 1000, cost=SpecCostModel(FREE_ROWS, draft_cost),
                       model_drafts=True, draft_stats=DraftStats())
    reqs = decoding(1)
    assert _step(spec, reqs, accepted=4)["r0"] == [7] * 4     # the guess, not placeholders
    # guesses that keep failing, drafts that are all accepted: it switches to the draft model
    sources = []
    for _ in range(6):
        spec.before_schedule(reqs)
        proposal = list(reqs[0].spec_token_ids)
        from_draft = proposal[0] == DRAFT_PLACEHOLDER
        sources.append("draft" if from_draft else "ngram")
        accepted = len(proposal) if from_draft else 0
        spec.record(SchedulerOutput(spec_token_ids={"r0": proposal}),
                    {"r0": [7] * accepted + [9]})
    assert sources[-3:] == ["draft"] * 3, sources


def test_nobody_speculates_where_even_perfect_guesses_do_not_pay():
    spec = SpecDecoder(7, Repeat(), 1000, cost=SpecCostModel(GGUF_ROWS))
    assert not any(_step(spec, decoding(32), accepted=0).values())
    assert all(h.backoff == 4 for h in spec._history.values()), "batch size is not the requests' fault"


def test_accounting_predicts_the_speedup_of_the_steps_run():
    spec = SpecDecoder(3, Repeat(), 1000, report_cost=SpecCostModel(GGUF_ROWS))
    reqs = decoding(1)
    spec.before_schedule(reqs)
    sched = SchedulerOutput(scheduled=reqs, num_scheduled_tokens={"r0": 4},
                            spec_token_ids={"r0": list(reqs[0].spec_token_ids)})
    spec.record(sched, {"r0": [7, 7, 9]})                 # 2 of 3 accepted + the target's
    # cost: one 4-row forward = 0.6 + 1.6; plain: 3 tokens at one step each
    assert spec.stats.predicted_cost == pytest.approx(2.2)
    assert spec.stats.plain_cost == pytest.approx(3.0)
    assert spec.stats.predicted_speedup == pytest.approx(3.0 / 2.2)


class Switch(Copying):
    """No guess until ``on`` is set, then Repeat's."""
    on = False

    def propose(self, token_ids, max_tokens):
        return super().propose(token_ids, max_tokens) if self.on else []


def test_a_paused_draft_model_does_not_stop_ngram_guesses():
    proposer = Switch()
    spec = SpecDecoder(4, proposer, 1000, model_drafts=True, draft_stats=DraftStats(),
                       cost=SpecCostModel(GGUF_ROWS, ForwardCost(fixed=0.05, per_row=0.05)))
    reqs = decoding(1)
    proposals = [_step(spec, reqs, accepted=0)["r0"]]
    while proposals[-1] and len(proposals) < 10:
        proposals.append(_step(spec, reqs, accepted=0)["r0"])
    assert proposals[0] and proposals[0][0] == DRAFT_PLACEHOLDER
    assert not proposals[-1], f"rejected drafts must pause the draft model: {proposals}"
    proposer.on = True                  # the very next step, the draft still paused
    assert _step(spec, reqs, accepted=0)["r0"][0] == 7, "the guess goes on while it pauses"


def test_min_gain_keeps_marginal_predictions_from_speculating():
    assert SpecCostModel(GGUF_ROWS).best_k(0.7, 7) > 0            # predicts ~1.1x
    assert SpecCostModel(GGUF_ROWS, min_gain=1.25).best_k(0.7, 7) == 0
    assert SpecCostModel(GGUF_ROWS, min_gain=1.25).best_k(0.9, 7) > 0
    with pytest.raises(ValueError, match="min_gain"):
        SpecCostModel(GGUF_ROWS, min_gain=0.9)


class ByLength(TokenProposer):
    """Token 7s, reported as matching ``matched`` tokens of context."""
    matched = 1

    def propose(self, token_ids, max_tokens):
        return [7] * max_tokens

    def propose_matched(self, token_ids, max_tokens):
        return self.propose(token_ids, max_tokens), self.matched


def test_ngram_acceptance_is_kept_per_match_length():
    proposer = ByLength()
    spec = SpecDecoder(4, proposer, 1000, model_drafts=True, draft_stats=DraftStats(),
                       cost=SpecCostModel(GGUF_ROWS, ForwardCost(fixed=2.0, per_row=0.5)))
    reqs = decoding(1)
    # a 1-2 token match is mostly chance: from its prior it is not worth costly rows
    assert _step(spec, reqs, accepted=0)["r0"] == []
    # mid-length matches start out trusted; when they keep failing their guesses stop ...
    proposer.matched = 4
    proposals = [_step(spec, reqs, accepted=0)["r0"] for _ in range(6)]
    assert proposals[0] == [7] * len(proposals[0]) and proposals[0]
    assert not proposals[-1], proposals
    # ... while a long match (a copied span) is still guessed at once, from its prior
    proposer.matched = 12
    assert _step(spec, reqs, accepted=4)["r0"][0] == 7
    hist = spec._history["r0"]
    assert hist.alpha_ngram[2] > hist.alpha_ngram[1]


def test_ngram_priors_follow_match_length():
    """The priors rise with the match length, and where rows are free even a chance match
    is worth a guess."""
    from kvforge.spec.decoder import _NGRAM_PRIORS
    assert list(_NGRAM_PRIORS) == sorted(_NGRAM_PRIORS) and 0 < _NGRAM_PRIORS[0] < 0.5
    proposer = ByLength()
    spec = SpecDecoder(4, proposer, 1000, cost=SpecCostModel(FREE_ROWS))
    assert _step(spec, decoding(1), accepted=0)["r0"] == [7] * 4


def _long_request(max_tokens: int):
    from kvforge.engine.request import Request
    from kvforge.sampling_params import SamplingParams
    req = Request("r0", list(range(500)), SamplingParams(max_tokens=max_tokens))
    req.append_output_token(4)
    req.num_computed_tokens = 500
    return req


def test_a_first_draft_runs_only_where_the_tokens_left_repay_its_catch_up():
    """The first draft of a request runs the draft model over its 500 tokens (a prefill,
    ~7 steps here): not for 2 tokens left (a batch shrinking late), yes for 99."""
    draft = ForwardCost.from_points([(1, 0.1), (2, 0.11), (64, 1.0)])
    for max_tokens, drafts in ((3, False), (100, True)):
        spec = SpecDecoder(4, None, 4096, cost=SpecCostModel(FREE_ROWS, draft),
                           model_drafts=True, draft_stats=DraftStats())
        req = _long_request(max_tokens)
        spec.before_schedule([req])
        assert (DRAFT_PLACEHOLDER in req.spec_token_ids) is drafts, (max_tokens,
                                                                     req.spec_token_ids)
