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
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.engine.request import Request
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import DRAFT_PLACEHOLDER, TokenProposer, is_eligible

_EMA = 0.5            # weight of the newest step in a request's acceptance average
_MAX_BACKOFF = 64


@dataclass
class SpecStats:
    num_verify_steps: int = 0        # request-steps that verified at least one proposed token
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0             # accepted + the target's own token, per verify step

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating request gains per step (1 = speculation saved nothing)."""
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass
class _History:
    k: int                       # this request's proposal length now
    ema: float = 1.0
    skip_steps: int = 0
    backoff: int = 4


@dataclass
class SpecDecoder:
    num_speculative_tokens: int
    token_proposer: TokenProposer | None       # None: a DraftProposer fills slots later
    max_len_per_request: int
    disable_batch_size: int = 32
    min_acceptance: float = 0.2
    max_verify_rows: int | None = None
    min_proposal: int = 2
    stats: SpecStats = field(default_factory=SpecStats)
    _history: dict[str, _History] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens!r}")
        if self.max_verify_rows is not None and self.max_verify_rows < 2:
            raise ValueError(f"max_verify_rows must be >= 2 or None, got {self.max_verify_rows!r}")

    def before_schedule(self, running: list[Request]) -> None:
        decoding = [r for r in running if r.num_remaining_tokens == 1]
        per_request = self.num_speculative_tokens
        if self.max_verify_rows is not None and decoding:
            per_request = min(per_request,
                              (self.max_verify_rows - len(decoding)) // len(decoding))
        active = len(decoding) <= self.disable_batch_size and per_request > 0
        live_ids = set()
        for req in running:
            req.spec_token_ids = []
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
            if self.token_proposer is None:
                req.spec_token_ids = [DRAFT_PLACEHOLDER] * k
            else:
                req.spec_token_ids = self.token_proposer.propose(req.all_token_ids, k)
        for rid in [rid for rid in self._history if rid not in live_ids]:
            del self._history[rid]

    def _max_proposal(self, req: Request) -> int:
        # all k accepted + the bonus must still fit max_tokens and the request's length cap,
        # so a length stop never falls inside the accepted run
        k = min(self.num_speculative_tokens, self.max_len_per_request - req.num_tokens - 1)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - req.num_output_tokens - 1)
        return k

    def record(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
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
            hist.ema = (1 - _EMA) * hist.ema + _EMA * accepted / len(drafts)
            if hist.ema < self.min_acceptance:
                hist.skip_steps = hist.backoff
                hist.backoff = min(hist.backoff * 2, _MAX_BACKOFF)
                hist.ema = 1.0           # retry with a clean slate after the pause
