"""Chi-square goodness of fit of sampled counts against exact probabilities.

scipy's ``chisquare`` requires the observed and expected totals to agree to 1.5e-8 relative;
expectations from float32 probabilities miss that on some CPUs (the sum of a float32 softmax
is 1 only to ~1e-7). So expectations are made in float64 and scaled to the observed total.
"""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def expected_counts(probs, total: float) -> np.ndarray:
    """``probs`` (any non-negative weights) scaled in float64 to sum to ``total``."""
    p = np.asarray(probs, dtype=np.float64)
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"probabilities must be non-negative with a positive sum, got {p}")
    return p / p.sum() * total


def chi_square_p_value(observed, expected) -> float:
    """p-value of ``observed`` counts against ``expected`` ones, the latter rescaled (float64)
    to the observed total first."""
    observed = np.asarray(observed, dtype=np.float64)
    return float(chisquare(observed, expected_counts(expected, observed.sum())).pvalue)
