"""SpecDecoder: the engine's one handle on speculative decoding.

Per step (LLMEngine.step):

    before_schedule(running)   decide which requests speculate and how many tokens (adaptive);
                               n-gram: the proposals themselves; draft: k placeholders
    Scheduler.schedule()       schedules 1 + len(request.spec_token_ids) for such a decode
                               (drops what the token budget cannot take) -> sched.spec_token_ids
    ModelRunner.execute()      draft proposer fills the placeholders (post-allocation), one target
                               forward over all rows, verify_proposals -> accepted + 1 tokens
    Scheduler.update_from_output  num_computed_tokens advances over the accepted tokens only,
                               whole blocks past the new length are freed (KVCacheManager.trim)
    record(sched, sampled)     stats + per-request acceptance history for the adaptive policy

Adaptive policy, by what a proposal costs:

* rows: on CPU a verification row is nearly free while the step's rows fit the linear kernel's
  few-rows tile (one pass over the weights for all of them: 8 rows with AVX-512); past it every
  row pays its own FLOPs. ``max_verify_rows`` caps decode rows + proposals per step and splits
  what is left evenly: k = 7 at batch 1, 3 at batch 2, 1 at 3-4, none from 5 decodes on
  (``kernels/ops.single_pass_rows``; None: no cap, e.g. GPUs). No request speculates while
  more than ``disable_batch_size`` decode.
* per request: a proposal rejected outright halves the request's next k (down to
  ``min_proposal``); one accepted whole restores the full k.
* pause: a request whose recent acceptance (exponential moving average) falls under
  ``min_acceptance`` stops proposing for ``backoff`` steps (doubling each time, up to 64). Worth
  it when proposing costs work of its own (a draft model's forwards); n-gram proposals cost only
  the rows above, so the n-gram decoder sets it to 0.
* cost model (``cost``, spec/cost.py, measured at start): replaces the row cap and the
  acceptance floor above. Each request keeps an estimate of its per-token acceptance alpha per
  proposer (an EMA over its steps); for n-gram guesses one per length of the context the guess
  matched (1-2, 3-7, 8+ tokens: chance vs a copied span), a length whose guesses do not pay
  sitting out its next guesses (doubling pauses) while the others and the draft model go on.
  With both an n-gram proposer and a draft model it takes, per step, whichever predicts the
  higher speedup: the n-gram guess (if there is one) at no draft cost, or the draft model;
  each at the k with the best predicted speedup for its alpha at this batch size, or neither
  when nothing beats decoding alone. If even alpha = 1 would not pay (rows cost too much at
  this batch size) nobody speculates and the history is kept; if only this request's alphas
  do not pay, the draft model or that match length sits out a while, then probes again from
  the prior. A request's first draft runs only where the tokens it may still decode repay the
  draft's catch-up over its whole context. A step in which no request speculates may run as a
  multi-step decode (engine/decode_steps.py): the draft model is lazy and catches up later
  (spec/draft.py).
* speed guard (``guard``, spec/speed_guard.py): last word over all of the above, from
  measurement. The engine times its decode-only steps (``observe_step``); at a batch size
  where steps that speculated gave fewer tokens a second than steps that did not, nobody
  speculates (re-measured by short probes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.engine.request import Request
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import DRAFT_PLACEHOLDER, TokenProposer, is_eligible
from kvforge.spec.cost import SpecCostModel
from kvforge.spec.speed_guard import SpeedGuard

_EMA = 0.5            # weight of the newest step in a request's acceptance average
_MAX_BACKOFF = 64
_ALPHA_EMA = 0.3      # weight of the newest step in a request's per-token acceptance estimate
_ALPHA_PRIOR = 0.8    # what a request's draft model is assumed to accept before it has drafted
# n-gram guesses keep their acceptance apart by the length of the context they matched: a
# match of 1-2 tokens is often chance, one of 8+ the answer copying its prompt
_MATCH_BUCKETS = (3, 8)           # lengths 1-2 | 3-7 | 8+
# ... and start from what each length was measured to accept: per-token acceptance of the
# guesses checked, pooled over the benchmark's workloads (Qwen2.5-Coder-1.5B on code edits,
# new code and ShareGPT chats; SmolLM2-135M on chats and copy edits: 0.17-0.49 | 0.53-0.94 |
# 0.95-1.00 per workload). From one prior of 0.8 each request paid a few 4-8-row steps on
# chance matches before their estimate fell, and on a 2-core AVX2 CPU (4 rows = 1.45 steps)
# those first steps made the speed guard hold speculation back for most of the first answer
# it saw (a docstring edit at 14.9 s, the target alone 14.1 s; from these priors 11.0 s)
_NGRAM_PRIORS = (0.35, 0.78, 0.97)
_NUM_BUCKETS = len(_MATCH_BUCKETS) + 1
assert len(_NGRAM_PRIORS) == _NUM_BUCKETS, "a prior per match-length bucket"


def _match_bucket(matched: int) -> int:
    return sum(matched >= edge for edge in _MATCH_BUCKETS)


@dataclass
class SpecStats:
    num_verify_steps: int = 0        # request-steps that verified at least one proposed token
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0             # accepted + the target's own token, per verify step
    num_ngram_steps: int = 0         # verify steps whose proposal was an n-gram guess
    # the cost model's account of decode steps, in single-row target forwards (cost model only):
    # what they cost with speculation, and what their tokens would cost one per step
    predicted_cost: float = 0.0
    plain_cost: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating request gains per step (1 = speculation saved nothing)."""
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def predicted_speedup(self) -> float:
        """Decode speed-up the cost model predicts for the steps run so far."""
        return self.plain_cost / self.predicted_cost if self.predicted_cost else 1.0


@dataclass
class _History:
    k: int                       # this request's proposal length now
    ema: float = 1.0
    alpha: float = _ALPHA_PRIOR          # per-token acceptance of the draft model's proposals
    # ... of n-gram guesses, per match-length bucket; a bucket whose guesses do not pay
    # sits out `ngram_skips` of its guesses, then probes again from the prior
    alpha_ngram: list[float] = field(default_factory=lambda: list(_NGRAM_PRIORS))
    ngram_skips: list[int] = field(default_factory=lambda: [0] * _NUM_BUCKETS)
    ngram_backoff: list[int] = field(default_factory=lambda: [4] * _NUM_BUCKETS)
    bucket: int = 0                      # the match-length bucket of the guess in flight
    skip_steps: int = 0
    backoff: int = 4
    draft_skip_steps: int = 0            # the draft model alone paused (n-gram guesses go on)
    draft_backoff: int = 4
    source: str = ""                     # the proposer of the step in flight: ngram | draft
    drafted: bool = False                # the draft model has run for this request


@dataclass
class SpecDecoder:
    num_speculative_tokens: int
    token_proposer: TokenProposer | None       # n-gram guesses; None: only a DraftProposer
    max_len_per_request: int
    disable_batch_size: int = 32
    min_acceptance: float = 0.2
    max_verify_rows: int | None = None
    min_proposal: int = 2
    cost: SpecCostModel | None = None
    # a DraftProposer fills placeholder slots after scheduling (None: when there is no
    # token_proposer); with both, n-gram guesses go first (cost model: whichever pays more)
    model_drafts: bool | None = None
    # the drafter's DraftStats: how many drafts needed a draft forward, its passes and rows
    draft_stats: object | None = None
    # a cost model that only accounts (stats.predicted_speedup), e.g. for a decoder without one
    report_cost: SpecCostModel | None = None
    # measured veto per batch size (None: the policy above decides alone)
    guard: SpeedGuard | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    _history: dict[str, _History] = field(default_factory=dict)
    _draft_seen: tuple[int, int] = (0, 0)      # draft (passes, rows) already accounted
    _draft_prefills_seen: int = 0

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens!r}")
        if self.max_verify_rows is not None and self.max_verify_rows < 2:
            raise ValueError(f"max_verify_rows must be >= 2 or None, got {self.max_verify_rows!r}")
        if self.model_drafts is None:
            self.model_drafts = self.token_proposer is None
        if not self.model_drafts and self.token_proposer is None:
            raise ValueError("a SpecDecoder needs a token proposer or a draft model")

    def before_schedule(self, running: list[Request]) -> None:
        decoding = [r for r in running if r.num_remaining_tokens == 1]
        per_request = self.num_speculative_tokens
        if self.max_verify_rows is not None and decoding:
            per_request = min(per_request,
                              (self.max_verify_rows - len(decoding)) // len(decoding))
        active = len(decoding) <= self.disable_batch_size and per_request > 0
        fraction = self._model_fraction()
        if self.cost is not None and decoding:
            # would a perfect proposer pay at this batch size? (its k rows cost the same)
            active = active and self.cost.best_k(1.0, per_request, len(decoding), 0.0) > 0
        if active and self.guard is not None and decoding:
            active = self.guard.allow(len(decoding))
        live_ids = set()
        for req in running:
            req.spec_token_ids = []
            req.num_lookahead_tokens = 0
        for req in decoding:
            live_ids.add(req.request_id)
            if not active or not is_eligible(req):
                continue
            hist = self._history.setdefault(req.request_id,
                                            _History(k=self.num_speculative_tokens))
            if hist.skip_steps > 0:
                hist.skip_steps -= 1
                continue
            k = min(hist.k, per_request, self._max_proposal(req))
            if k <= 0:
                continue
            guess, matched = (self.token_proposer.propose_matched(req.lookup_token_ids, k)
                              if self.token_proposer is not None else ([], 0))
            if self.cost is None:
                if guess or not self.model_drafts:
                    req.spec_token_ids, hist.source = guess, "ngram"
                else:
                    req.spec_token_ids, hist.source = [DRAFT_PLACEHOLDER] * k, "draft"
                continue
            batch = len(decoding)
            bucket = _match_bucket(matched)
            if guess and hist.ngram_skips[bucket] > 0:
                hist.ngram_skips[bucket] -= 1
                guess = []
            ngram_k, ngram_gain = (self.cost.best(hist.alpha_ngram[bucket], len(guess), batch,
                                                  0.0) if guess else (0, 1.0))
            draft_k, draft_gain = 0, 1.0
            if self.model_drafts and hist.draft_skip_steps > 0:
                hist.draft_skip_steps -= 1
            elif self.model_drafts:
                draft_k, draft_gain = self.cost.best(hist.alpha, k, batch, fraction)
                if draft_k and not hist.drafted and not self._first_draft_pays(req, draft_gain):
                    draft_k, draft_gain = 0, 1.0
                elif not draft_k and self.cost.best_k(1.0, k, batch, fraction):
                    # its acceptance, not its price, is what does not pay: pause the draft
                    # model for this request (n-gram guesses go on), then probe again
                    hist.draft_skip_steps = hist.draft_backoff
                    hist.draft_backoff = min(hist.draft_backoff * 2, _MAX_BACKOFF)
                    hist.alpha = _ALPHA_PRIOR
            if ngram_k and ngram_gain >= draft_gain:
                req.spec_token_ids, hist.source = guess[:ngram_k], "ngram"
                hist.bucket = bucket
            elif draft_k:
                req.spec_token_ids, hist.source = [DRAFT_PLACEHOLDER] * draft_k, "draft"
                hist.drafted = True
            if guess and not ngram_k and self.cost.best_k(1.0, len(guess), batch, 0.0):
                # this bucket's acceptance does not pay now: it sits out its next guesses
                # (doubling pauses), then probes from the prior; the draft model and guesses
                # of other match lengths go on
                hist.alpha_ngram[bucket] = _NGRAM_PRIORS[bucket]
                hist.ngram_skips[bucket] = hist.ngram_backoff[bucket]
                hist.ngram_backoff[bucket] = min(hist.ngram_backoff[bucket] * 2, _MAX_BACKOFF)
        for rid in [rid for rid in self._history if rid not in live_ids]:
            del self._history[rid]

    def _first_draft_pays(self, req: Request, gain: float) -> bool:
        """A request's first draft runs the draft model over all its tokens (its prompt and
        output so far: one forward of that many rows, priced by the cost model's last
        segment): worth it only if the tokens it may still decode save more at ``gain``. A
        request that reaches the draft late (a batch shrinking to where drafting pays, its
        last few tokens left) would pay a prompt's prefill for a handful of drafts."""
        left = self.max_len_per_request - req.num_tokens
        if req.max_tokens is not None:
            left = min(left, req.max_tokens - req.num_output_tokens)
        return left * (1.0 - 1.0 / gain) > self.cost.draft(req.num_tokens)

    def _max_proposal(self, req: Request) -> int:
        # all k accepted + the bonus must still fit max_tokens and the request's length cap,
        # so a length stop never falls inside the accepted run
        k = min(self.num_speculative_tokens, self.max_len_per_request - req.num_tokens - 1)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - req.num_output_tokens - 1)
        return k

    def record(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        if (self.cost or self.report_cost) is not None:
            self._account(self.cost or self.report_cost, sched, sampled)
        for rid, drafts in sched.spec_token_ids.items():
            tokens = sampled.get(rid)
            if not drafts or not tokens:
                continue
            accepted = len(tokens) - 1
            self.stats.num_verify_steps += 1
            self.stats.num_proposed += len(drafts)
            self.stats.num_accepted += accepted
            self.stats.num_emitted += len(tokens)
            hist = self._history.get(rid)
            if hist is None:
                continue
            if accepted == len(drafts):
                hist.k = self.num_speculative_tokens
            elif accepted == 0:
                hist.k = max(min(self.min_proposal, self.num_speculative_tokens), hist.k // 2)
            # per-token acceptance seen this step: `accepted` successes, then one failure
            # unless the whole proposal went through
            seen = accepted / (accepted + (accepted < len(drafts)))
            if hist.source == "ngram":
                self.stats.num_ngram_steps += 1
                b = hist.bucket
                hist.alpha_ngram[b] = (1 - _ALPHA_EMA) * hist.alpha_ngram[b] + _ALPHA_EMA * seen
            else:
                hist.alpha = (1 - _ALPHA_EMA) * hist.alpha + _ALPHA_EMA * seen
            hist.ema = (1 - _EMA) * hist.ema + _EMA * accepted / len(drafts)
            if self.cost is None and hist.ema < self.min_acceptance:
                self._pause(hist)
                hist.ema = 1.0           # retry with a clean slate after the pause

    def observe_step(self, sched: SchedulerOutput, sampled: dict[str, list[int]],
                     seconds: float) -> None:
        """Tell the speed guard what a step cost: only steps whose scheduled requests all
        decode (a prefill chunk would swamp the difference) and in which the draft model ran
        no prefill of a prompt (once per request) are measured."""
        if self.guard is None:
            return
        if self.draft_stats is not None:
            prefills = self.draft_stats.num_prefills
            drafted_a_prompt = prefills != self._draft_prefills_seen
            self._draft_prefills_seen = prefills
            if drafted_a_prompt:
                return
        if not sched.scheduled or sched.preempted_request_ids:
            return
        decodes = _decodes(sched, sampled)
        if len(decodes) != len(sched.scheduled):
            return
        speculated = any(sched.spec_token_ids.get(rid) for rid in decodes)
        self.guard.record(len(decodes), speculated, seconds,
                          sum(len(sampled[rid]) for rid in decodes))

    def _account(self, cost: SpecCostModel, sched: SchedulerOutput,
                 sampled: dict[str, list[int]]) -> None:
        """Add the step's predicted cost, and what its tokens would cost one per step, to the
        stats (decode requests only: prefill is the same with and without speculation)."""
        draft_cost = 0.0
        if self.draft_stats is not None and cost.draft is not None:
            passes, rows = self.draft_stats.num_passes, self.draft_stats.num_rows
            seen_passes, seen_rows = self._draft_seen
            if passes > seen_passes:         # the passes' mean row count prices them
                draft_cost = (passes - seen_passes) * cost.draft(
                    (rows - seen_rows) / (passes - seen_passes))
            self._draft_seen = (passes, rows)
        rows = emitted = num_decodes = 0
        steps = 1
        for rid in _decodes(sched, sampled):
            num_decodes += 1
            rows += 1 + len(sched.spec_token_ids.get(rid, ()))
            emitted += len(sampled[rid])
            steps = max(steps, 1 + sched.num_lookahead_tokens.get(rid, 0))
        if not num_decodes:
            return
        if steps > 1:                            # a multi-step decode: the same either way
            self.stats.predicted_cost += steps * cost.target(num_decodes)
            self.stats.plain_cost += steps * cost.target(num_decodes)
            return
        self.stats.predicted_cost += cost.target(rows) + draft_cost
        self.stats.plain_cost += emitted * cost.target(num_decodes) / num_decodes

    @staticmethod
    def _pause(hist: _History) -> None:
        hist.skip_steps = hist.backoff
        hist.backoff = min(hist.backoff * 2, _MAX_BACKOFF)

    def _model_fraction(self) -> float:
        stats = self.draft_stats
        if stats is None or not stats.num_drafts:
            return 1.0
        return stats.num_model_drafts / stats.num_drafts


def _decodes(sched: SchedulerOutput, sampled: dict[str, list[int]]) -> list[str]:
    """Ids of the step's requests that decoded: one row for their last token plus their
    proposals or lookahead slots, no prompt tokens."""
    out = []
    for req in sched.scheduled:
        rid = req.request_id
        ahead = len(sched.spec_token_ids.get(rid, ())) + sched.num_lookahead_tokens.get(rid, 0)
        if sampled.get(rid) and sched.num_scheduled_tokens[rid] == 1 + ahead:
            out.append(rid)
    return out
