"""EarlyExitLM: a Llama-family or Gemma 3 model whose forward exits early (exit/forward.py),
used by the engine (``--early-exit-threshold``) and by ``kvforge eval perplexity``.

Everything else (KV facts, weights, parameters) is the wrapped model's. The compiled decode
stack runs every layer, so it is off here: decodes take the Python layers, one step at a time.
The logits of exited rows were already made by the confidence check; ``compute_logits`` of the
hidden states ``forward`` just returned reuses them instead of paying the LM head twice.
"""
from __future__ import annotations

import torch

from kvforge.exit.forward import ExitStats, early_exit_forward
from kvforge.exit.heads import ExitHeads


def validate_threshold(threshold) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0.0 < threshold <= 1.0:
        raise ValueError(f"early_exit_threshold must be in (0, 1], got {threshold!r}")
    return float(threshold)


class EarlyExitLM:
    def __init__(self, model, heads: ExitHeads, threshold: float,
                 exit_all_rows: bool = False) -> None:
        """``exit_all_rows``: every row may exit (teacher-forced evaluation); otherwise only the
        last row of each sequence whose query is one token (a decode)."""
        from kvforge.models.layerwise import CachedLayers
        self._layers = CachedLayers(model, "early exit")     # refuses other families first
        if heads.num_layers != model.num_layers:
            raise ValueError(f"exit heads for {heads.num_layers} layers, model has "
                             f"{model.num_layers}")
        self.model_impl = model
        self.heads = heads.to(next(model.parameters()).device)
        self.threshold = validate_threshold(threshold)
        self.exit_all_rows = exit_all_rows
        self.stats = ExitStats(model.num_layers)
        self._last = None          # (hidden returned, exited rows, their logits)

    def __getattr__(self, name):
        # only called for names this object lacks: the wrapped model's facts and weights
        return getattr(self.__dict__["model_impl"], name)

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        eligible = None if self.exit_all_rows else decode_rows(meta, input_ids.shape[0])
        result = early_exit_forward(self._layers, self.heads, self.threshold, input_ids,
                                    positions, kv_caches, meta, eligible, self.stats)
        self._last = (result.hidden, result.exited_rows, result.exit_logits)
        return result.hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        last, rows, logits = self._last if self._last is not None else (None, None, None)
        if hidden is not last or logits is None:
            return self.model_impl.compute_logits(hidden)
        keep = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        keep[rows] = False
        out = logits.new_empty(hidden.shape[0], logits.shape[-1])
        out[rows] = logits
        if bool(keep.any()):
            out[keep] = self.model_impl.compute_logits(hidden[keep])
        return out

    # the compiled stack runs every layer: no multi-step decoding, no stack path
    def decode_stack(self):
        return None

    def can_decode_steps(self, num_seqs: int) -> bool:
        return False


def decode_rows(meta, num_rows: int) -> torch.Tensor:
    """Rows of sequences scheduled with a one-token query (decodes): the rows that exit."""
    lens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
    ends = torch.cumsum(lens, 0) - 1
    eligible = torch.zeros(num_rows, dtype=torch.bool)
    eligible[ends[lens == 1]] = True
    return eligible


def describe_exits(stats: ExitStats) -> str:
    per_layer = ", ".join(f"after {e}: {n / max(1, stats.rows):.1%}"
                          for e, n in sorted(stats.exits.items()))
    return (f"layers skipped: {stats.skipped_fraction:.1%} of {stats.rows} tokens x "
            f"{stats.num_layers} layers; exits {per_layer or 'none'}; exit-head checks "
            f"{stats.head_checks / max(1, stats.rows):.2f} per token")
