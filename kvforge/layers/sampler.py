"""Batched token sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, logprobs.

Every per-request knob becomes a ``[B]`` tensor in a ``SamplingBatch`` built once per step, so
the math is one pass over the ``[B, V]`` logits whatever the mix of requests. Order (vLLM's):

    raw logits ──► raw logprobs = log_softmax(raw logits)      (only if a row asks logprobs=k)
        │
        ├─ repetition penalty   tokens of prompt + output: l > 0 ? l / r : l * r
        ├─ frequency / presence tokens of output only:     l -= f * count + p * (count > 0)
        ├─ min_tokens           EOS / stop_token_ids → -inf while too few outputs
        ├─ grammar              structured output: tokens the row's grammar refuses → -inf
        │
        ├─ greedy rows  ──► argmax
        └─ random rows  ──► / temperature → top-k → top-p → min-p → softmax → exponential race

The exponential race samples ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per token: the
index i wins with probability ``probs[i]`` (q_i / probs_i are exponentials of rate probs_i and the
smallest one wins). A row with its own seeded ``torch.Generator`` draws its own q, so its token
depends only on its logits and its generator, never on which other rows share the step.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kvforge.engine.request import Request
from kvforge.kernels import ops as kernel_ops
from kvforge.structured.bitmask import apply_grammars

# Below this temperature a row is treated as greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5


def _flat_pairs(rows: list[int], seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of every listed sequence, as two flat tensors."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    return row_idx.to(device), token_ids.to(device)


def _check_token_ids(token_ids: torch.Tensor, vocab_size: int, what: str) -> None:
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"{what} token id out of range [0, {vocab_size}): "
                         f"min {int(token_ids.min())}, max {int(token_ids.max())}")


@dataclass
class SamplingBatch:
    """Sampling inputs of one step, one row per request, built by ``from_requests``.

    ``all_greedy`` / ``all_random`` / ``no_*`` flags let the sampler skip whole stages. Penalty
    tensors are ``None`` when no row needs them; rows without penalties hold neutral values.
    """

    vocab_size: int
    is_greedy: torch.Tensor               # [B] bool
    temperature: torch.Tensor             # [B] float32; 1.0 on greedy rows (never divided by 0)
    top_k: torch.Tensor                   # [B] int64 in [1, V]; V = disabled, 1 on greedy rows
    top_p: torch.Tensor                   # [B] float32 in (0, 1]
    min_p: torch.Tensor                   # [B] float32 in [0, 1]
    repetition_penalty: torch.Tensor      # [B] float32
    frequency_penalty: torch.Tensor       # [B] float32
    presence_penalty: torch.Tensor        # [B] float32
    seen_token_mask: torch.Tensor | None  # [B, V] bool: token in prompt or output (rep. penalty)
    output_token_counts: torch.Tensor | None  # [B, V] float32: occurrences among outputs
    min_tokens_rows: torch.Tensor | None  # [M] int64 \ (row, token) pairs masked to -inf because
    min_tokens_token_ids: torch.Tensor | None  # [M] / the row has fewer than min_tokens outputs
    # (row, token, value) triples of the rows' logit_bias, added to the logits; None: no row has
    # one (static per request, so a reused batch stays right)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    generators: list[torch.Generator | None]  # per row; None = the global RNG
    num_logprobs: list[int | None]        # per row, the request's ``logprobs``
    # per row the request's GrammarMatcher (None: unconstrained); None when no row has one.
    # The mask is read from the matchers at every call, so a reused batch stays correct.
    grammar_matchers: list | None
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def reusable(self) -> bool:
        """Nothing in this batch depends on the requests' outputs (no penalties, every row past
        its min_tokens), so the next step of the same requests may sample with it again."""
        return self.no_penalties and self.min_tokens_rows is None

    @property
    def max_num_logprobs(self) -> int | None:
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int,
                      device: torch.device | str = "cpu") -> "SamplingBatch":
        """Row i samples for ``requests[i]``, whose outputs so far are ``output_token_ids``."""
        if not requests:
            raise ValueError("SamplingBatch needs at least one request, got an empty list")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size!r}")
        params = [r.sampling_params for r in requests]
        greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]

        def f32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # greedy rows get k = 1 so they never widen the batch's top-k candidate set
        top_k = [1 if g else vocab_size if p.top_k < 0 else min(p.top_k, vocab_size)
                 for g, p in zip(greedy, params)]

        # Penalties: (row, token) pairs of the rows that use them, scattered in one call each.
        seen_mask = counts = None
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            rows, ids = _flat_pairs(rep_rows, [requests[i].all_token_ids for i in rep_rows], device)
            _check_token_ids(ids, vocab_size, "prompt/output")
            seen_mask = torch.zeros(len(requests), vocab_size, dtype=torch.bool, device=device)
            seen_mask[rows, ids] = True
        freq_rows = [i for i, p in enumerate(params)
                     if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if freq_rows:
            rows, ids = _flat_pairs(freq_rows, [requests[i].output_token_ids for i in freq_rows],
                                    device)
            _check_token_ids(ids, vocab_size, "output")
            counts = torch.zeros(len(requests), vocab_size, dtype=torch.float32, device=device)
            counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32),
                              accumulate=True)

        # min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be sampled yet.
        blocked_rows, blocked_ids = [], []
        for i, (req, p) in enumerate(zip(requests, params)):
            if req.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
                blocked_rows.append(i)
                blocked_ids.append(sorted(ids))
        min_rows = min_ids = None
        if any(blocked_ids):
            min_rows, min_ids = _flat_pairs(blocked_rows, blocked_ids, device)
            _check_token_ids(min_ids, vocab_size, "EOS/stop")

        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        logit_bias = None
        if bias_rows:
            rows, ids = _flat_pairs(bias_rows, [list(params[i].logit_bias) for i in bias_rows],
                                    device)
            _check_token_ids(ids, vocab_size, "logit_bias")
            logit_bias = (rows, ids, f32([v for i in bias_rows
                                          for v in params[i].logit_bias.values()]))

        # the per-row float knobs in one tensor (rows are views): one call instead of six
        knobs = f32([[1.0 if g else p.temperature for g, p in zip(greedy, params)],
                     [p.top_p for p in params], [p.min_p for p in params],
                     [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                     [p.presence_penalty for p in params]])
        return cls(
            vocab_size=vocab_size,
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=knobs[0],
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=knobs[1],
            min_p=knobs[2],
            repetition_penalty=knobs[3],
            frequency_penalty=knobs[4],
            presence_penalty=knobs[5],
            seen_token_mask=seen_mask,
            output_token_counts=counts,
            min_tokens_rows=min_rows,
            min_tokens_token_ids=min_ids,
            logit_bias=logit_bias,
            # greedy rows never draw, so a seeded greedy request leaves its generator untouched
            generators=[None if g else r.generator for g, r in zip(greedy, requests)],
            num_logprobs=[p.logprobs for p in params],
            grammar_matchers=(None if all(r.grammar_matcher is None for r in requests)
                              else [r.grammar_matcher for r in requests]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            # greedy rows' knobs are irrelevant, so they do not switch a stage on
            no_top_k=all(k >= vocab_size for g, k in zip(greedy, top_k) if not g),
            no_top_p=all(g or p.top_p >= 1.0 for g, p in zip(greedy, params)),
            no_min_p=all(g or p.min_p <= 0.0 for g, p in zip(greedy, params)),
            no_penalties=seen_mask is None and counts is None,
        )


@dataclass
class SamplerOutput:
    """Row i belongs to the batch's request i.

    ``logprobs`` / ``logprob_token_ids`` are ``[B, K+1]`` with K the largest ``logprobs`` asked
    in the batch (``None`` if no row asked): column 0 is the sampled token, columns 1..K its top-K
    by raw logprob. A row that asked for k < K reads ``[:, :k+1]``; rows that asked nothing
    ignore theirs. ``logprob_ranks[i]`` is the sampled token's 1-based rank (1 = most likely).
    """

    sampled_token_ids: torch.Tensor            # [B] int64
    logprobs: torch.Tensor | None = None       # [B, K+1] float32
    logprob_token_ids: torch.Tensor | None = None  # [B, K+1] int64
    logprob_ranks: torch.Tensor | None = None  # [B] int64

    def logprobs_dict(self, row: int, k: int) -> dict[int, float]:
        """{token_id: logprob} of the sampled token and row's top-k (the OpenAI shape)."""
        if self.logprobs is None or self.logprob_token_ids is None:
            raise ValueError("no row of this batch asked for logprobs")
        ids = self.logprob_token_ids[row, : k + 1].tolist()
        return dict(zip(ids, self.logprobs[row, : k + 1].tolist()))


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N, k+1] logprobs, [N, k+1] ids, [N] ranks): token_ids' logprob first, then the top-k."""
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k == 0:
        return chosen, chosen_ids, ranks
    top = logprobs.topk(k, dim=-1)
    return (torch.cat([chosen, top.values], dim=1), torch.cat([chosen_ids, top.indices], dim=1),
            ranks)


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor,
                            k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``prompt_logprobs``: row n scores ``next_token_ids[n]`` given the tokens before it.

    Returns ``(logprobs [N, k+1], token_ids [N, k+1])``: the actual next token first, then the
    top-k of ``log_softmax(logits)``.
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(f"expected logits [N, V] and next_token_ids [N], got "
                         f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    logprobs, ids, _ = _gather_logprobs(torch.log_softmax(logits.float(), dim=-1),
                                        next_token_ids, min(k, logits.shape[1]))
    return logprobs, ids


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency, presence penalties and the min_tokens mask (out of place)."""
    if batch.seen_token_mask is not None:
        r = batch.repetition_penalty.unsqueeze(1)
        # r > 1 pushes every seen token towards "less likely" whatever the logit's sign
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(batch.seen_token_mask, penalised, logits)
    if batch.output_token_counts is not None:
        counts = batch.output_token_counts
        logits = (logits - batch.frequency_penalty.unsqueeze(1) * counts
                  - batch.presence_penalty.unsqueeze(1) * (counts > 0).float())
    if batch.min_tokens_rows is not None:
        logits = logits.index_put((batch.min_tokens_rows, batch.min_tokens_token_ids),
                                  torch.tensor(-math.inf, device=logits.device))
    return logits


def _mask_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k, then outside its top-p nucleus.

    Works on the candidates sorted by logit: all V tokens, or only the largest ``max(top_k)``
    when every row limits k (a full sort of a 49k vocabulary costs far more than a top-50 ``topk``).
    A token tied exactly with a row's k-th logit may survive or not depending on that choice.
    """
    vocab_size = logits.shape[1]
    max_k = vocab_size if batch.no_top_k else int(batch.top_k.max())
    if max_k <= vocab_size // 2:
        cand_logits, cand_ids = logits.topk(max_k, dim=-1)       # sorted, descending
    else:
        cand_logits, cand_ids = logits.sort(dim=-1, descending=True)
    if not batch.no_top_k:
        kth = cand_logits.gather(1, (batch.top_k - 1).unsqueeze(1))
        cand_logits = cand_logits.masked_fill(cand_logits < kth, -math.inf)
    if not batch.no_top_p:
        # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass
        # strictly before it is still short of top_p, so the most likely token always stays.
        #   probs        .50 .30 .15 .05      top_p = .7
        #   mass before  .00 .50 .80 .95  →   keep  .50 .30
        cand_probs = cand_logits.softmax(dim=-1)
        mass_before = cand_probs.cumsum(dim=-1) - cand_probs
        cand_logits = cand_logits.masked_fill(mass_before >= batch.top_p.unsqueeze(1), -math.inf)
    return torch.full_like(logits, -math.inf).scatter_(1, cand_ids, cand_logits)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] distribution a random row samples from (after penalties were applied).

    Temperature, top-k, top-p, min-p, softmax. Greedy rows get temperature 1 and are meant to be
    ignored. Exposed for speculative decoding, which needs the same target distribution.
    """
    logits = logits / batch.temperature.unsqueeze(1)
    if not (batch.no_top_k and batch.no_top_p):
        logits = _mask_top_k_top_p(logits, batch)
    if not batch.no_min_p:
        # prob < min_p * max_prob  ⇔  logit < max_logit + log(min_p)   (log 0 = -inf: no-op)
        cut = logits.amax(dim=-1, keepdim=True) + torch.log(batch.min_p).unsqueeze(1)
        logits = logits.masked_fill(logits < cut, -math.inf)
    return logits.softmax(dim=-1)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One sample per row of ``probs`` [B, V]: ``argmax(probs / q)``, q ~ Exp(1).

    Rows with a generator draw their q from it alone (V numbers per step), so a seeded request
    is reproducible regardless of batch size or its row position.
    """
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, gen in enumerate(generators):
        if gen is None:
            continue
        if gen.device == q.device:
            q[row].exponential_(generator=gen)
        else:   # a CPU generator for a GPU batch: draw where the generator lives
            q[row] = torch.empty(q.shape[1], dtype=q.dtype, device=gen.device).exponential_(
                generator=gen).to(q.device)
    # q == 0 has probability ~0 but would make probs / q infinite (or NaN at a masked token)
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return kernel_ops.argmax_last_dim(probs / q)


class Sampler:
    """``Sampler()(logits [B, V] float32, batch) -> SamplerOutput``; stateless."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (batch.batch_size, batch.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match the batch "
                             f"({batch.batch_size}, {batch.vocab_size})")
        logits = logits.float()
        # "raw" logprobs (vLLM's default): the model's distribution before any processing
        max_k = batch.max_num_logprobs
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_k is not None else None

        if batch.logit_bias is not None:      # OpenAI: added before sampling, penalties after
            rows, ids, values = batch.logit_bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if not batch.no_penalties or batch.min_tokens_rows is not None:
            logits = apply_penalties(logits, batch)
        if batch.grammar_matchers is not None:
            logits = apply_grammars(logits, batch.grammar_matchers)
        greedy_ids = None if batch.all_random else kernel_ops.argmax_last_dim(logits)
        if batch.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = exponential_race(sampling_probs(logits, batch), batch.generators)
            sampled = (random_ids if batch.all_random
                       else torch.where(batch.is_greedy, greedy_ids, random_ids))

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.logprobs, out.logprob_token_ids, out.logprob_ranks = _gather_logprobs(
                raw_logprobs, sampled, min(max_k, batch.vocab_size))
        return out
