"""Build the engine's speculative decoding parts from EngineConfig."""
from __future__ import annotations

import logging

import torch

from kvforge.kernels import ops as kernel_ops
from kvforge.spec.decoder import SpecDecoder
from kvforge.spec.draft import ModelDraftProposer
from kvforge.spec.ngram import NgramProposer
from kvforge.spec.self_draft import SelfDraftModel

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft")


def build_spec_decoder(config, runner, max_len_per_request: int) -> SpecDecoder | None:
    """None when speculation is off; for ``draft`` also sets ``runner.drafter``."""
    method = config.speculative_method
    if method in (None, "", "none"):
        return None
    # verification rows per step: what the CPU linear kernel takes in one pass over the weights
    max_rows = kernel_ops.single_pass_rows(runner.device, runner.dtype)
    if method == "ngram":
        # proposals cost only verification rows: shrink on rejection, never pause
        return SpecDecoder(config.num_speculative_tokens, NgramProposer(
            config.speculative_ngram_min, config.speculative_ngram_max), max_len_per_request,
            min_acceptance=0.0, max_verify_rows=max_rows)
    target = runner.model
    if config.speculative_draft_model:
        runner.drafter = _load_draft_model(config, runner)
    else:
        layers = config.speculative_draft_layers or max(1, target.num_layers // 4)
        runner.drafter = ModelDraftProposer(SelfDraftModel(target, layers), runner.block_size,
                                            runner.device)
        logger.info("self-draft: first %d of %d layers", layers, target.num_layers)
    return SpecDecoder(config.num_speculative_tokens, None, max_len_per_request,
                       max_verify_rows=max_rows)


def _load_draft_model(config, runner) -> ModelDraftProposer:
    """A separate draft (same tokenizer/vocabulary) with its own KV tensors over the same blocks."""
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    source = load_model_source(config.speculative_draft_model)
    if source.config.vocab_size != runner.model_config.vocab_size:
        raise ValueError(f"draft model {config.speculative_draft_model!r} has vocabulary "
                         f"{source.config.vocab_size}, the target {runner.model_config.vocab_size}")
    draft = load_model(source, attn_backend=config.attention_backend, dtype=runner.dtype,
                       device=runner.device)
    draft.eval()
    shape = draft.kv_cache_shape(runner.num_blocks, runner.block_size)
    dtype = draft.kv_cache_dtype() if hasattr(draft, "kv_cache_dtype") else runner.dtype
    caches = [torch.zeros(shape, dtype=dtype, device=runner.device)
              for _ in range(draft.num_layers)]
    logger.info("draft model %s: %d layers, own KV cache over the target's %d blocks",
                config.speculative_draft_model, draft.num_layers, runner.num_blocks)
    return ModelDraftProposer(draft, runner.block_size, runner.device, own_kv_caches=caches)
