"""Model-based drafting after scheduling: the self-draft (shares the target's KV) or a separate
draft model with its own paged KV cache indexed by the *same* block tables (same block ids and
block size, its own per-layer tensors), so the scheduler's allocation covers both.

Passes for a speculating request with T tokens (last one, at T-1, not computed yet) and k
lookahead slots (positions T .. T+k-1):

    pass 1   self-draft: the last token                       -> d_1
             draft model: catch-up + candidate, in one forward:
               positions e .. T-1   the tokens the draft's cache misses (e = its KV end, below)
               positions T .. T+m-1 an n-gram candidate c_1..c_m (greedy requests, if any)
             the rows at T-1, T, .. T+m-1 predict g_1 .. g_{m+1}: the drafts are c_1..c_i while
             c_j == g_j, then g_{i+1} (the draft's own guess at the first disagreement)
    pass j   input: the last draft at the next position      -> one more draft, until k

One forward reads the draft's weights once for all its rows, so a candidate the draft agrees
with costs a row, not a forward: copied spans (edits, quoting the prompt) come at about the
price of one draft token, and the draft fills in elsewhere.

The draft model's KV (rollback): a drafting pass leaves the draft's cache holding the request's
T real tokens, then the drafts it fed back in (all but the last), at T, T+1, ... Later, its KV
is right up to the first of those drafts that differs from the request's token there (the
target rejected it), and never past num_computed_tokens: the next pass 1 starts there, so
the rejected drafts' slots are simply rewritten (no copy, no undo). A step in which a request
does not speculate (an n-gram guess, a pause) leaves the draft behind; the catch-up rows of its
next drafting pass fill it in (a request the drafter has not seen starts at 0: the draft runs
its prefill then). So the draft costs nothing on the steps it is not used, which may then
decode several tokens per call (engine/decode_steps.py).

Prefix-cache hits (a new turn of a chat, a shared system prompt, a preempted request
recomputed): the draft's KV lives in the same block ids as the target's, so a block the
draft filled with real tokens still holds them when the prefix cache hands it to another
request. ``_filled_blocks`` keeps those ids: a block joins once the draft's KV is right for
every slot of it (all its positions < the request's T), and leaves when the pool hands it
out for new contents (``forget_block``, hooked to BlockPool.on_block_reused). A request's
catch-up starts after the leading blocks of its table that are in the set:

    table     [ b7 | b2 | b9 | b4 | ... ]      b7, b2 filled by the draft for an earlier turn
    positions   0..15 16..31 32..47            (block size 16)
    catch-up                 ^ starts at 32, not 0
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.engine.request import Request
from kvforge.kernels import ops as kernel_ops
from kvforge.layers.sampler import SamplingBatch, exponential_race, sampling_probs
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import DRAFT_PLACEHOLDER, DraftProposer
from kvforge.spec.ngram import NgramProposer


@dataclass
class DraftStats:
    num_passes: int = 0              # draft forwards
    num_rows: int = 0                # rows over all of them
    num_model_drafts: int = 0        # drafts the model guessed (one forward each, but pass 1's)
    num_ngram_drafts: int = 0        # candidate tokens the draft agreed with (no forward of their own)
    num_early_stops: int = 0         # proposals cut short by low draft confidence
    num_prefills: int = 0            # catch-up passes over (part of) a request's prompt
    seconds: float = 0.0             # wall time in propose

    @property
    def num_drafts(self) -> int:
        return self.num_model_drafts + self.num_ngram_drafts


@dataclass
class _Written:
    """A request's last drafting pass: the draft's cache holds its first ``num_real`` tokens
    and then ``drafts`` (fed back in, so their KV is written), through ``table``."""
    request: Request
    num_real: int
    drafts: list[int]
    table: list[int]


class ModelDraftProposer(DraftProposer):
    def __init__(self, draft_model, block_size: int, device: torch.device,
                 own_kv_caches: list[torch.Tensor] | None = None,
                 ngram: NgramProposer | None = None, min_confidence: float = 0.0) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence!r}")
        if ngram is not None and own_kv_caches is None:
            raise ValueError("n-gram candidates need a separate draft model (its catch-up pass)")
        self.model = draft_model
        self.block_size = block_size
        self.device = device
        # None: the draft reads and writes the target's caches (self-draft)
        self.own_kv_caches = own_kv_caches
        self.ngram = ngram
        # greedy drafting stops after a draft whose probability is below this (0: never)
        self.min_confidence = min_confidence
        self.vocab_size = getattr(draft_model, "vocab_size", None) or draft_model.config.vocab_size
        self.stats = DraftStats()
        # request_id -> what the draft's cache holds for it (see the module docstring)
        self._written: dict[str, _Written] = {}
        self._max_ahead = 0              # the longest proposal asked for so far
        # block ids whose every slot holds the draft's KV of the block's real tokens (above)
        self._filled_blocks: set[int] = set()

    def forget_block(self, block_id: int) -> None:
        """The pool handed ``block_id`` out for new contents: the draft's KV there is stale."""
        self._filled_blocks.discard(block_id)

    def _forward(self, ids: list[int], query_lens: list[int], context_lens: list[int],
                 tables: list[list[int]], kv_caches: list[torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size,
                                       self.device)
        x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.stats.num_passes += 1
        self.stats.num_rows += len(ids)
        return self.model(x, meta.positions(), kv_caches, meta)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, target_kv_caches: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        try:
            return self._propose(sched, target_kv_caches)
        finally:
            self.stats.seconds += time.perf_counter() - start

    def _propose(self, sched: SchedulerOutput, target_kv_caches: list[torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
        kv = self.own_kv_caches if self.own_kv_caches is not None else target_kv_caches
        if self.own_kv_caches is not None:
            self._mirror_copies(sched)
            self._forget_finished()
        # requests whose proposal is an n-gram guess (real ids) need no draft this step
        spec = [r for r in sched.scheduled
                if sched.spec_token_ids.get(r.request_id, [None])[0] == DRAFT_PLACEHOLDER]
        if not spec:
            return {}
        ks = [len(sched.spec_token_ids[r.request_id]) for r in spec]
        self._max_ahead = max(self._max_ahead, *ks)
        tables = [sched.block_ids[r.request_id] for r in spec]

        # pass 1: rows[i] are request i's rows whose outputs predict drafts 1, 2, ..
        cands = [self._candidate(r, k) for r, k in zip(spec, ks)]
        if self.own_kv_caches is None:
            hidden = self._forward([r.all_token_ids[-1] for r in spec], [1] * len(spec),
                                   [r.num_tokens - 1 for r in spec], tables, kv)
            rows = [[i] for i in range(len(spec))]
        else:
            hidden, rows = self._catch_up_pass(spec, cands, tables, kv)
        drafts: list[list[int]] = [[] for _ in spec]
        q_rows: list[list[torch.Tensor]] = [[] for _ in spec]
        done = [False] * len(spec)
        flat = [row for r in rows for row in r]
        owner = [i for i, r in enumerate(rows) for _ in r]
        tokens, conf, probs = self._pick(hidden[flat], [spec[i] for i in owner])
        at = 0
        for i, req_rows in enumerate(rows):
            guesses = tokens[at:at + len(req_rows)]
            agreed = 0
            while agreed < len(cands[i]) and cands[i][agreed] == guesses[agreed]:
                agreed += 1
            drafts[i] = cands[i][:agreed] + [guesses[agreed]]
            self.stats.num_ngram_drafts += agreed
            self.stats.num_model_drafts += 1
            if probs is not None and not spec[i].sampling_params.greedy:
                q_rows[i].append(probs[at])
            done[i] = self._stop(conf, at + agreed, len(drafts[i]), ks[i])
            at += len(req_rows)

        # passes 2..: one row per request that still drafts
        while True:
            live = [i for i in range(len(spec)) if not done[i]]
            if not live:
                break
            hidden = self._forward([drafts[i][-1] for i in live], [1] * len(live),
                                   [spec[i].num_tokens - 1 + len(drafts[i]) for i in live],
                                   [tables[i] for i in live], kv)
            tokens, conf, probs = self._pick(hidden, [spec[i] for i in live])
            for row, i in enumerate(live):
                drafts[i].append(tokens[row])
                self.stats.num_model_drafts += 1
                if probs is not None and not spec[i].sampling_params.greedy:
                    q_rows[i].append(probs[row])
                done[i] = self._stop(conf, row, len(drafts[i]), ks[i])

        out: dict[str, torch.Tensor] = {}
        for i, req in enumerate(spec):
            rid = req.request_id
            if len(drafts[i]) < ks[i]:       # stopped early: give the unused slots back
                sched.num_scheduled_tokens[rid] -= ks[i] - len(drafts[i])
            sched.spec_token_ids[rid][:] = drafts[i]
            if self.own_kv_caches is not None:
                # the drafts fed back in: all but the last
                self._written[rid] = _Written(req, req.num_tokens, drafts[i][:-1],
                                              list(tables[i]))
                # its KV is right for positions < num_tokens: the whole blocks below are filled
                self._filled_blocks.update(tables[i][:req.num_tokens // self.block_size])
            if q_rows[i]:
                out[rid] = torch.stack(q_rows[i])
        return out

    def _candidate(self, req: Request, k: int) -> list[int]:
        """An n-gram guess to check in pass 1 (greedy only: a sampled request's drafts must be
        drawn from the draft's q). At most k - 1: the draft's own guess follows it."""
        if self.ngram is None or not req.sampling_params.greedy or k < 2:
            return []
        return self.ngram.propose(req.lookup_token_ids, k - 1)

    def _stop(self, conf: list[float] | None, row: int, num_drafts: int, k: int) -> bool:
        if num_drafts >= k:
            return True
        if conf is not None and conf[row] < self.min_confidence:
            self.stats.num_early_stops += 1
            return True
        return False

    def _catch_up_pass(self, spec: list[Request], cands: list[list[int]],
                       tables: list[list[int]], kv) -> tuple[torch.Tensor, list[list[int]]]:
        """Pass 1 of a separate draft model: per request the tokens its cache misses, then its
        candidate. Returns the hidden rows and, per request, the rows that predict drafts."""
        segments = []
        for req, cand, table in zip(spec, cands, tables):
            start = self._kv_start(req, table)
            if start < req.num_prompt_tokens:
                self.stats.num_prefills += 1
            ids = req.all_token_ids[start:] + cand
            segments.append((ids, start, table))
        # decodes (one row) first: AttentionMetadata's layout
        order = sorted(range(len(spec)), key=lambda i: len(segments[i][0]) != 1)
        ids, q_lens, ctx, ordered_tables, first = [], [], [], [], {}
        for i in order:
            seg_ids, start, table = segments[i]
            first[i] = len(ids)
            ids.extend(seg_ids)
            q_lens.append(len(seg_ids))
            ctx.append(start)
            ordered_tables.append(table)
        hidden = self._forward(ids, q_lens, ctx, ordered_tables, kv)
        rows = []
        for i, req in enumerate(spec):
            last_real = first[i] + req.num_tokens - 1 - segments[i][1]
            rows.append(list(range(last_real, last_real + 1 + len(cands[i]))))
        return hidden, rows

    def _kv_start(self, req: Request, table: list[int]) -> int:
        """First position whose draft KV is not known to be right for the request's tokens
        (at most its last token's: pass 1 needs that row)."""
        filled = 0
        while filled < len(table) and table[filled] in self._filled_blocks:
            filled += 1
        last = req.num_tokens - 1
        return min(max(self._written_end(req, table), filled * self.block_size), last)

    def _written_end(self, req: Request, table: list[int]) -> int:
        """How far this request's own last drafting pass left the draft's KV right."""
        written = self._written.get(req.request_id)
        if written is None or written.request is not req:
            return 0
        # the drafts it fed are right where the request's tokens (accepted since, by this or
        # later steps) agree with them
        tokens, end = req.all_token_ids, written.num_real
        for draft in written.drafts:
            if end >= len(tokens) or tokens[end] != draft:
                break
            end += 1
        # after a preemption the request may sit in other blocks (prefix cache hits on blocks
        # the draft never wrote, recomputed ones): trust only the blocks it wrote through
        same = 0
        while (same < min(len(table), len(written.table))
               and table[same] == written.table[same]):
            same += 1
        return min(end, req.num_computed_tokens, same * self.block_size)

    def _forget_finished(self) -> None:
        for rid in [rid for rid, w in self._written.items() if w.request.status.is_finished]:
            del self._written[rid]

    def _mirror_copies(self, sched: SchedulerOutput) -> None:
        if not sched.block_copies:
            return
        # the runner copied the target's shared blocks (copy-on-write); mirror it here
        src = torch.tensor([s for s, _ in sched.block_copies], device=self.device)
        dst = torch.tensor([d for _, d in sched.block_copies], device=self.device)
        for cache in self.own_kv_caches:
            cache[:, dst] = cache[:, src]

    def _pick(self, hidden: torch.Tensor, requests: list[Request]
              ) -> tuple[list[int], list[float] | None, torch.Tensor | None]:
        """Per row: the draft token (argmax, or drawn from q for sampling requests), its
        probability when early stopping needs it, and q [rows, V] when any row samples."""
        logits = self.model.compute_logits(hidden).float()
        tokens = kernel_ops.argmax_last_dim(logits)
        batch = SamplingBatch.from_requests(requests, self.vocab_size, self.device)
        probs = None
        if not batch.all_greedy:
            probs = sampling_probs(logits, batch)
            sampled = exponential_race(probs, batch.generators)
            tokens = torch.where(batch.is_greedy, tokens, sampled)
        conf = None
        if self.min_confidence > 0.0:
            # the greedy draft's own probability: 1 / sum(exp(logit - max))
            conf = (1.0 / torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1)).tolist()
        return tokens.tolist(), conf, probs

    def check_integrity(self, num_blocks: int) -> None:
        """The draft's caches cover exactly the target's block pool (the same block ids); every
        KV end it keeps is its request's and lies inside the slots the request was given."""
        for cache in self.own_kv_caches or ():
            if cache.shape[1] != num_blocks:
                raise AssertionError(f"draft KV cache has {cache.shape[1]} blocks, the pool "
                                     f"{num_blocks}")
        stray = [b for b in self._filled_blocks if not 0 <= b < num_blocks]
        if stray or (self._filled_blocks and self.own_kv_caches is None):
            raise AssertionError(f"draft-filled blocks {sorted(stray or self._filled_blocks)} "
                                 f"outside the draft's own pool of {num_blocks}")
        for rid, written in self._written.items():
            req = written.request
            # it wrote the request's tokens then len(drafts) <= k drafts after them
            if (req.request_id != rid or not 0 < written.num_real <= req.num_tokens
                    or len(written.drafts) >= max(self._max_ahead, 1)):
                raise AssertionError(f"draft KV of request {rid!r}: {written.num_real} tokens "
                                     f"+ {len(written.drafts)} drafts, the request has "
                                     f"{req.num_tokens} tokens and proposals <= "
                                     f"{self._max_ahead}")
