"""Model-based drafting after scheduling: the self-draft (shares the target's KV) or a separate
draft model with its own paged KV cache indexed by the *same* block tables (same block ids and
block size, its own per-layer tensors), so the scheduler's allocation covers both.

Passes for a request with T tokens (last one not computed yet) and k lookahead slots:

    pass 1   input: the step's real tokens     -> logits at the last one -> d_1
             (self-draft: only the last token; a separate model also runs prefill chunks and
              every other request's tokens, so its cache keeps up with the target's)
    pass j   input: d_{j-1} at position T+j-2   -> d_j           (j = 2..k)
    (separate model only) one more KV-only pass writes d_k at T+k-1: if all k are accepted
    the next step starts at T+k and needs it.
"""
from __future__ import annotations

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels import ops as kernel_ops
from kvforge.layers.sampler import SamplingBatch, exponential_race, sampling_probs
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.base import DraftProposer


class ModelDraftProposer(DraftProposer):
    def __init__(self, draft_model, block_size: int, device: torch.device,
                 own_kv_caches: list[torch.Tensor] | None = None) -> None:
        self.model = draft_model
        self.block_size = block_size
        self.device = device
        # None: the draft reads and writes the target's caches (self-draft)
        self.own_kv_caches = own_kv_caches
        self.vocab_size = getattr(draft_model, "vocab_size", None) or draft_model.config.vocab_size

    def _forward(self, ids: list[int], query_lens: list[int], context_lens: list[int],
                 tables: list[list[int]], kv_caches: list[torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size,
                                       self.device)
        x = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.model(x, meta.positions(), kv_caches, meta)

    @torch.inference_mode()
    def propose(self, sched: SchedulerOutput, target_kv_caches: list[torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        """Called every step: a separate draft model also computes the steps without drafts."""
        kv = self.own_kv_caches if self.own_kv_caches is not None else target_kv_caches
        if self.own_kv_caches is not None and sched.block_copies:
            # the runner copied the target's shared blocks (copy-on-write); mirror it here
            src = torch.tensor([s for s, _ in sched.block_copies], device=self.device)
            dst = torch.tensor([d for _, d in sched.block_copies], device=self.device)
            for cache in self.own_kv_caches:
                cache[:, dst] = cache[:, src]
        spec = [r for r in sched.scheduled if sched.spec_token_ids.get(r.request_id)]
        if not spec:
            if self.own_kv_caches is not None and sched.scheduled:
                self._shadow_pass(sched, [], kv)      # keep the draft's cache in step
            return {}
        ks = [len(sched.spec_token_ids[r.request_id]) for r in spec]
        tables = [sched.block_ids[r.request_id] for r in spec]

        # pass 1
        if self.own_kv_caches is None:
            ids = [r.all_token_ids[-1] for r in spec]
            hidden = self._forward(ids, [1] * len(spec), [r.num_tokens - 1 for r in spec],
                                   tables, kv)
            last_rows = list(range(len(spec)))
        else:
            hidden, last_rows = self._shadow_pass(sched, spec, kv)
        batch = SamplingBatch.from_requests(spec, self.vocab_size, self.device)
        drafts: list[list[int]] = [[] for _ in spec]
        q_rows: list[list[torch.Tensor]] = [[] for _ in spec]
        self._sample(hidden[last_rows], batch, list(range(len(spec))), drafts, q_rows)

        # passes 2..k over the requests that still need drafts
        for j in range(1, max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            hidden = self._forward([drafts[i][-1] for i in live], [1] * len(live),
                                   [spec[i].num_tokens - 1 + j for i in live],
                                   [tables[i] for i in live], kv)
            self._sample(hidden, _select(batch, live, spec, self.vocab_size, self.device),
                         live, drafts, q_rows)
        if self.own_kv_caches is not None:
            self._forward([d[-1] for d in drafts], [1] * len(spec),
                          [r.num_tokens - 1 + k for r, k in zip(spec, ks)], tables, kv)

        probs: dict[str, torch.Tensor] = {}
        for i, req in enumerate(spec):
            sched.spec_token_ids[req.request_id][:] = drafts[i]
            if q_rows[i]:
                probs[req.request_id] = torch.stack(q_rows[i])
        return probs

    def _shadow_pass(self, sched: SchedulerOutput, spec, kv) -> tuple[torch.Tensor, list[int]]:
        """Pass 1 of a separate draft model: every scheduled real token, like the target."""
        ids, q_lens, ctx, tables, ends = [], [], [], [], {}
        for req in sched.scheduled:
            rid = req.request_id
            n = sched.num_scheduled_tokens[rid] - len(sched.spec_token_ids.get(rid, ()))
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            q_lens.append(n)
            ctx.append(start)
            tables.append(sched.block_ids[rid])
            ends[rid] = len(ids) - 1
        # decodes first (AttentionMetadata's layout): stable sort by query length != 1
        order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] != 1)
        if order != list(range(len(q_lens))):
            starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
            ids = [t for i in order for t in ids[starts[i]:starts[i] + q_lens[i]]]
            new_end, pos = {}, 0
            for i in order:
                pos += q_lens[i]
                new_end[sched.scheduled[i].request_id] = pos - 1
            ends = new_end
            q_lens, ctx, tables = ([x[i] for i in order] for x in (q_lens, ctx, tables))
        hidden = self._forward(ids, q_lens, ctx, tables, kv)
        return hidden, [ends[r.request_id] for r in spec]

    def _sample(self, hidden: torch.Tensor, batch: SamplingBatch, rows_of: list[int],
                drafts: list[list[int]], q_rows: list[list[torch.Tensor]]) -> None:
        logits = self.model.compute_logits(hidden).float()
        tokens = kernel_ops.argmax_last_dim(logits)
        if not batch.all_greedy:
            probs = sampling_probs(logits, batch)
            sampled = exponential_race(probs, batch.generators)
            tokens = torch.where(batch.is_greedy, tokens, sampled)
        for row, (i, token) in enumerate(zip(rows_of, tokens.tolist())):
            drafts[i].append(token)
            if not batch.is_greedy[row]:
                q_rows[i].append(probs[row])


def _select(batch: SamplingBatch, live: list[int], spec, vocab_size: int, device) -> SamplingBatch:
    if len(live) == len(spec):
        return batch
    return SamplingBatch.from_requests([spec[i] for i in live], vocab_size, device)
