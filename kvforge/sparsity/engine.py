"""Activation sparsity for an engine's model: cached (or freshly calibrated) thresholds, then
the decode stack's sparse projections; neither where the step could not run them sparse."""
from __future__ import annotations

import logging

from kvforge.sparsity.cache import load_or_calibrate
from kvforge.sparsity.decode import enable_sparse_decode, why_dense

logger = logging.getLogger(__name__)


def enable_activation_sparsity(model, source, config) -> int:
    reason = why_dense(model, config.activation_sparsity_mode)
    if reason is not None:              # before calibrating: a minute of prefills for nothing
        logger.warning("%s; decoding dense", reason)
        return 0
    thresholds = load_or_calibrate(model, source, config.activation_sparsity,
                                   config.activation_sparsity_mode, config.quantization,
                                   config.activation_sparsity_allocation,
                                   rotation=config.activation_sparsity_rotation)
    covered = enable_sparse_decode(model, thresholds)
    logger.info("activation sparsity %s S=%.2f (rotation %s): %d projections sparse in decode "
                "steps", config.activation_sparsity_mode, config.activation_sparsity,
                config.activation_sparsity_rotation, covered)
    return covered
