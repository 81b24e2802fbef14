"""Build the engine's speculative decoding parts from EngineConfig."""
from __future__ import annotations

import logging

import torch

from kvforge.kernels import ops as kernel_ops
from kvforge.quant.gguf import integer_rows_max
from kvforge.spec.cost import calibrate
from kvforge.spec.decoder import SpecDecoder
from kvforge.spec.draft import ModelDraftProposer
from kvforge.spec.ngram import NgramProposer
from kvforge.spec.self_draft import SelfDraftModel
from kvforge.spec.speed_guard import SpeedGuard

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft", "early-exit")
SPECULATION_MIN_GAIN = 1.05


def build_spec_decoder(config, runner, max_len_per_request: int,
                       tokenizer=None) -> SpecDecoder | None:
    """None when speculation is off; for ``draft`` also sets ``runner.drafter``.
    ``tokenizer``: the target's (a draft borrowing its head ranks tokens with it; loaded from
    the model file when not given)."""
    method = config.speculative_method
    if method in (None, "", "none"):
        return None
    decoder = _build(config, runner, max_len_per_request, tokenizer)
    # measured last word: no speculation at batch sizes where it ran slower than decoding alone
    decoder.guard = SpeedGuard() if config.speculative_speed_guard else None
    if decoder.guard is not None and runner.drafter is not None and decoder.draft_stats is None:
        decoder.draft_stats = runner.drafter.stats      # its prompt prefills are not measured
    return decoder


def _build(config, runner, max_len_per_request: int, tokenizer) -> SpecDecoder:
    method = config.speculative_method
    # verification rows per step: what the CPU linear kernel takes in one pass over the weights
    max_rows = kernel_ops.single_pass_rows(runner.device, runner.dtype)
    # and, for GGUF blocks, fewer than the rows from which a projection leaves its integer dots
    # (their many-row kernels round otherwise: a verified token would not be the plain step's)
    exact_rows = integer_rows_max(runner.model)
    if exact_rows is not None:
        max_rows = exact_rows if max_rows is None else min(max_rows, exact_rows)
    if method == "ngram":
        # proposals cost only verification rows, priced as timed (a second pass of the fp32
        # kernel included): k per request from its acceptance (per match length), none where
        # no guess pays; rows capped only below a GGUF crossover
        cost = calibrate(_timed_forward(runner, runner.model, runner.kv_caches, logits_rows=None),
                         rows=exact_rows or 8, min_gain=SPECULATION_MIN_GAIN)
        logger.info("speculation costs (single-row target forwards) by rows: target %s",
                    cost.target.describe())
        return SpecDecoder(config.num_speculative_tokens, NgramProposer(
            config.speculative_ngram_min, config.speculative_ngram_max), max_len_per_request,
            cost=cost, max_verify_rows=exact_rows)
    target = runner.model
    if method == "early-exit":
        draft = _with_frequent_head(_exit_draft(config, runner), config, runner, tokenizer)
        runner.drafter = ModelDraftProposer(draft, runner.block_size, runner.device)
        return SpecDecoder(config.num_speculative_tokens, None, max_len_per_request,
                           max_verify_rows=max_rows)
    if runner.draft_model is None:
        layers = config.speculative_draft_layers or max(1, target.num_layers // 4)
        draft = _with_frequent_head(SelfDraftModel(target, layers), config, runner, tokenizer)
        runner.drafter = ModelDraftProposer(draft, runner.block_size, runner.device)
        logger.info("self-draft: first %d of %d layers", layers, target.num_layers)
        return SpecDecoder(config.num_speculative_tokens, None, max_len_per_request,
                           max_verify_rows=max_rows)
    ngram = (NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
             if config.speculative_draft_ngram else None)
    runner.drafter = ModelDraftProposer(runner.draft_model, runner.block_size, runner.device,
                                        own_kv_caches=runner.draft_kv_caches, ngram=ngram,
                                        min_confidence=config.speculative_draft_min_confidence)
    # a draft model's tokens cost forwards of their own and GGUF verification rows are not
    # free: k per request from the measured costs (spec/cost.py), no fixed row cap
    cost = calibrate(_timed_forward(runner, runner.model, runner.kv_caches, logits_rows=None),
                     _timed_forward(runner, runner.draft_model, runner.draft_kv_caches,
                                    logits_rows=1),
                     rows=exact_rows or 8,
                     # with rows timed up to the most a step verifies, predictions on the
                     # Qwen2.5-Coder pair came within ~5% of the measured speed-ups (a line
                     # through 1 and 4 rows had run ~25% high): a small margin for what it
                     # does not price (bookkeeping, no multi-step decoding)
                     min_gain=SPECULATION_MIN_GAIN)
    logger.info("speculation costs (single-row target forwards) by rows: target %s, draft %s",
                cost.target.describe(), cost.draft.describe())
    # n-gram guesses first where they pay more (no draft forward); the draft model elsewhere
    return SpecDecoder(config.num_speculative_tokens, ngram, max_len_per_request, cost=cost,
                       model_drafts=True, draft_stats=runner.drafter.stats,
                       max_verify_rows=exact_rows)


def _exit_draft(config, runner):
    """The target's first E layers + its trained exit head (E: --speculative-draft-layers, or
    the shallowest head trained)."""
    from kvforge.exit.store import load_heads_for
    from kvforge.spec.exit_draft import ExitDraftModel
    heads = load_heads_for(runner.model, runner.model_path)
    draft = ExitDraftModel(runner.model, heads, config.speculative_draft_layers)
    logger.info("early-exit draft: first %d of %d layers + exit head", draft.num_layers,
                runner.model.num_layers)
    return draft


def _with_frequent_head(draft, config, runner, tokenizer):
    """A draft made of the target's first layers borrows the target's LM head: over its most
    frequent tokens where the vocabulary is large (FR-Spec, spec/frequent_vocab.py; Gemma 3's
    262,144 x 640 head is most of what its draft token would read)."""
    from kvforge.spec.frequent_vocab import install, resolve_size
    if resolve_size(config.speculative_draft_vocab, runner.model.config.vocab_size) == 0:
        return draft                                    # the whole head: nothing to rank
    if tokenizer is None:
        from kvforge.loader.source import load_model_source
        tokenizer = load_model_source(runner.model_path).load_tokenizer()
    install(draft, tokenizer, config.speculative_draft_vocab, head_owner=runner.model)
    return draft


def _timed_forward(runner, model, kv_caches, logits_rows: int | None):
    """forward(rows): one sequence of ``rows`` new tokens after 64 cached ones, in blocks of the
    pool that nothing holds yet (the engine has not started; the slots are rewritten before
    any request reads them), then the LM head over the last ``logits_rows`` rows (None: all of
    them, as verification does)."""
    from kvforge.attention.metadata import AttentionMetadata
    context, most_rows = 64, 64                 # up to cost.PREFILL_ROWS rows (the draft's)
    needed = (context + most_rows) // runner.block_size + 1
    table = list(range(min(needed, runner.num_blocks)))
    context = max(0, min(context, len(table) * runner.block_size - most_rows))

    def forward(rows: int):
        meta = AttentionMetadata.build([rows], [context], [table], runner.block_size,
                                       runner.device)
        ids = torch.zeros(rows, dtype=torch.int64, device=runner.device)
        hidden = model(ids, meta.positions(), kv_caches, meta)
        return model.compute_logits(hidden if logits_rows is None else hidden[-logits_rows:])
    return forward


def load_draft_model(config, target_source, device: torch.device, dtype: torch.dtype):
    """The separate draft model, quantized like the target would be (``--quantization``:
    a GGUF file runs in its own blocks), after checking that it speaks the target's
    vocabulary: every draft token id is verified as the target's token of the same id."""
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    name = config.speculative_draft_model
    source = load_model_source(name)
    check_same_vocabulary(name, source, target_source)
    draft = load_model(source, quantization=config.quantization,
                       quantization_args=config.quantization_args,
                       attn_backend=config.attention_backend, dtype=dtype, device=device)
    draft.eval()
    logger.info("draft model %s: %d layers", name, draft.num_layers)
    from kvforge.spec.frequent_vocab import install
    install(draft, source.load_tokenizer(), config.speculative_draft_vocab)
    return draft


def check_same_vocabulary(name: str, draft_source, target_source) -> None:
    """ValueError naming the draft and the first difference unless both models have the same
    embedding rows and their tokenizers map every id to the same token."""
    d_rows, t_rows = draft_source.config.vocab_size, target_source.config.vocab_size
    if d_rows != t_rows:
        raise ValueError(f"draft model {name!r} has a vocabulary of {d_rows} tokens, the target "
                         f"{t_rows}: a draft must share the target's tokenizer")
    d_tok, t_tok = draft_source.load_tokenizer(), target_source.load_tokenizer()
    if d_tok.vocab_size != t_tok.vocab_size:
        raise ValueError(f"draft model {name!r}: its tokenizer has {d_tok.vocab_size} tokens, "
                         f"the target's {t_tok.vocab_size}")
    ids = range(t_tok.vocab_size)
    d_tokens, t_tokens = d_tok.convert_ids_to_tokens(ids), t_tok.convert_ids_to_tokens(ids)
    if d_tokens != t_tokens:
        i = next(i for i, (a, b) in enumerate(zip(d_tokens, t_tokens)) if a != b)
        raise ValueError(f"draft model {name!r}: token id {i} is {d_tokens[i]!r} in its "
                         f"tokenizer but {t_tokens[i]!r} in the target's")
