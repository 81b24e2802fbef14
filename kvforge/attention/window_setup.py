"""Which attention window an engine runs, from its flags or the model's own config.

- Engine flags ``attention_sinks`` S / ``sliding_window`` W (``--attention-sinks``,
  ``--sliding-window``): StreamingLLM on every layer, in-cache positions (``window.py``), and
  the context is no longer bounded by the model (``max_model_len`` may exceed it; default
  ``STREAMING_MAX_MODEL_LEN``) because no query-key distance ever exceeds S + W - 1.
- Otherwise a model config's ``sliding_window`` (Mistral; Qwen2 / Qwen2-MoE only with
  ``use_sliding_window``, on the layers its ``layer_types`` (or ``max_window_layers``) name):
  a true-position window on those layers, only when it can matter (W < max_model_len).
  A model class with ``applies_own_sliding_window`` (Gemma 3) builds its windowed layers
  itself and gets no plan here; with StreamingLLM flags its other layers take the flags' window
  (``own_attention_windows``: its own windows must fit inside it).

KV blocks are freed only when every layer is windowed (a full-attention layer still reads the
whole context) and one window sees what every other does (the widest: its dead blocks are dead
for all). Freed blocks break prefix sharing, so the prefix cache is then off.
Combinations that would read a freed block or a wrong window are refused with a ValueError:
another cache layout (tiled, QUEST; an fp8 KV cache is fine), a separate draft model (its KV
through tables with freed entries), swap preemption, and model families without rotary
Llama-style attention.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvforge.attention.window import AttentionWindow

if TYPE_CHECKING:
    import torch

    from kvforge.config import EngineConfig
    from kvforge.models.config import ModelConfig

logger = logging.getLogger(__name__)

# max_model_len when StreamingLLM is on and none is given: generation is bounded by max_tokens,
# EOS or this, not by memory (a request holds at most max_live_blocks KV blocks)
STREAMING_MAX_MODEL_LEN = 2**31 - 1


@dataclass(frozen=True)
class WindowPlan:
    """Per decoder layer its window (None = full attention), and where it came from."""

    layers: tuple[AttentionWindow | None, ...]
    from_flags: bool              # StreamingLLM flags (in-cache positions): past the context

    @property
    def kv_window(self) -> AttentionWindow | None:
        """The window whose out-of-window blocks can be freed: with every layer windowed, the
        one that sees at least the sinks and the window of every other (a layer of S' <= S
        sinks and W' <= W sees keys [0, S') and (p - W', p], inside [0, S) and (p - W, p])."""
        if not self.layers or any(w is None for w in self.layers):
            return None
        widest = max(self.layers, key=lambda w: (w.window, w.sinks))
        if all(w.window <= widest.window and w.sinks <= widest.sinks for w in self.layers):
            return widest
        return None


def validate_window_args(config: "EngineConfig") -> None:
    """EngineConfig.__post_init__: the flags alone (the model is not known yet)."""
    sinks, window = config.attention_sinks, config.sliding_window
    if not isinstance(sinks, int) or isinstance(sinks, bool) or sinks < 0:
        raise ValueError(f"attention_sinks must be an integer >= 0, got {sinks!r}")
    if window is None:
        if sinks:
            raise ValueError(f"attention_sinks={sinks} needs a sliding_window (StreamingLLM "
                             f"attends to the sinks plus the last sliding_window tokens)")
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    if window < config.block_size:
        raise ValueError(f"sliding_window {window} is smaller than one KV block "
                         f"({config.block_size} tokens): no block could ever be freed")
    _check_compatible(config, f"sliding_window={window}")


def _check_compatible(config: "EngineConfig", what: str) -> None:
    from kvforge.attention.windowed import windowed_backend_cls
    try:
        windowed_backend_cls(config.attention_backend)    # a storage with a windowed backend
    except ValueError:
        raise ValueError(f"{what} runs on the paged KV layout (fp32 or fp8 K/V); it cannot be "
                         f"combined with attention_backend={config.attention_backend!r} "
                         f"(sparse_attention={config.sparse_attention!r})") from None
    if config.speculative_method not in (None, "none", "ngram", "early-exit"):
        # n-gram guesses need no KV of their own and the early-exit draft runs the target's own
        # (windowed) first layers; a draft model's KV would be read through block tables whose
        # out-of-window entries are freed, by attention that does not know the window
        raise ValueError(f"{what} can be combined with n-gram or early-exit speculation, not "
                         f"speculative_method={config.speculative_method!r}")
    if config.preemption_mode != "recompute":
        raise ValueError(f"{what} frees out-of-window KV blocks; preemption_mode="
                         f"{config.preemption_mode!r} would swap a partly freed block table "
                         f"(use recompute)")


def native_window_layers(model_config: "ModelConfig") -> list[bool]:
    """Which layers apply the model's own ``sliding_window`` (HF semantics)."""
    hf = model_config.hf_config
    num_layers = model_config.num_hidden_layers
    layer_types = hf.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        return [t == "sliding_attention" for t in layer_types]
    if hf.get("model_type") == "qwen2" and "max_window_layers" in hf:
        return [i >= hf["max_window_layers"] for i in range(num_layers)]
    return [True] * num_layers


def _check_architecture(model_config: "ModelConfig", what: str) -> None:
    from kvforge.models.llama import LlamaForCausalLM
    from kvforge.models.registry import get_model_class
    if not issubclass(get_model_class(model_config.architecture), LlamaForCausalLM):
        raise ValueError(f"{what}: windowed attention needs a Llama-family model (rotary "
                         f"attention over the paged cache); {model_config.architecture} is not")


def _own_attention_windows(model_config: "ModelConfig") -> list[AttentionWindow | None] | None:
    """A model class's own per-layer windows (``own_attention_windows``), or None."""
    from kvforge.models.registry import get_model_class
    if not _applies_own_sliding_window(model_config):
        return None
    return get_model_class(model_config.architecture).own_attention_windows(model_config)


def _applies_own_sliding_window(model_config: "ModelConfig") -> bool:
    from kvforge.models.registry import get_model_class
    return getattr(get_model_class(model_config.architecture), "applies_own_sliding_window",
                   False)


def resolve_attention_window(config: "EngineConfig",
                             model_config: "ModelConfig") -> WindowPlan | None:
    """The engine's window plan, or None for full attention everywhere. Pure: the engine (KV
    manager, context length) and the runner (attention backends) both call it."""
    num_layers = model_config.num_hidden_layers
    if config.sliding_window is not None:
        what = f"attention_sinks={config.attention_sinks}, sliding_window={config.sliding_window}"
        window = AttentionWindow(config.attention_sinks, config.sliding_window, "in_cache")
        context = model_config.max_position_embeddings
        if window.span > context:
            raise ValueError(f"{what}: sinks + window = {window.span} tokens exceeds the model's "
                             f"context of {context}; in-cache positions must stay inside it")
        own = _own_attention_windows(model_config)
        if own is not None:          # the model's windowed layers keep theirs, inside the flags'
            widest = max((w.window for w in own if w is not None), default=0)
            if widest > window.window:
                raise ValueError(f"{what}: the model's own sliding window ({widest}) is wider "
                                 f"than sliding_window; StreamingLLM frees the blocks outside "
                                 f"the flags' window, which those layers still read")
            return WindowPlan(tuple(w if w is not None else window for w in own),
                              from_flags=True)
        _check_architecture(model_config, what)
        return WindowPlan((window,) * num_layers, from_flags=True)
    size = model_config.sliding_window
    max_len = config.max_model_len or model_config.max_position_embeddings
    if not size or size >= max_len:
        return None                 # no query can reach past the window: full attention is exact
    if _applies_own_sliding_window(model_config):
        return None                 # its layers carry their windows (e.g. models/gemma3.py)
    layers = native_window_layers(model_config)
    if not any(layers):
        return None
    what = f"model sliding_window={size} (< max_model_len {max_len})"
    _check_architecture(model_config, what)
    _check_compatible(config, what)
    window = AttentionWindow(0, size, "true")
    return WindowPlan(tuple(window if on else None for on in layers), from_flags=False)


def log_prefix_caching(plan: WindowPlan | None, requested: bool) -> bool:
    """Whether the prefix cache may run with this plan (logs when the window turns it off)."""
    if plan is None or plan.kv_window is None:
        return requested
    if requested:
        logger.info("prefix caching off: the attention window frees KV blocks a shared prefix "
                    "would need")
    return False


def configure_attention_window(model: "torch.nn.Module",
                               config: "EngineConfig") -> WindowPlan | None:
    """Give every attention layer of a loaded model its window (ModelRunner, after loading):
    each layer's ``paged`` backend becomes a ``WindowedAttentionBackend`` (over the same fp32 or
    fp8 storage) with its layer's
    window and the model's RoPE frequencies; StreamingLLM also makes the rotary table serve
    positions past the context."""
    from kvforge.attention.paged import PagedAttentionBackend
    from kvforge.attention.windowed import windowed_backend_cls
    from kvforge.layers.rotary import compute_inv_freq
    from kvforge.layers.rotary_unbounded import UnboundedRotaryEmbedding

    model_config = getattr(model, "config", None)
    if model_config is None:
        return None
    plan = resolve_attention_window(config, model_config)
    if plan is None:
        return None
    own_windows = getattr(model, "applies_own_sliding_window", False)
    if own_windows:       # its own RoPE modules (models/gemma3.py: computed, any position)
        rotary = inner = None
        inv_freq = model.window_rope_inv_freq()
    else:
        rotary = model.model.rotary_emb
        inner = rotary.inner if isinstance(rotary, UnboundedRotaryEmbedding) else rotary
        inv_freq, _ = compute_inv_freq(inner.rotary_dim, model_config.rope_theta,
                                       model_config.rope_scaling,
                                       model_config.max_position_embeddings)
    attentions = [m for m in model.modules() if isinstance(getattr(m, "attn", None),
                                                           PagedAttentionBackend)]
    if len(attentions) != len(plan.layers):
        raise ValueError(f"found {len(attentions)} paged attention layers for "
                         f"{len(plan.layers)} windows in {type(model).__name__}")
    device = next(model.parameters()).device
    for module, window in zip(attentions, plan.layers):
        old = module.attn
        if own_windows and getattr(old, "window", None) is not None:
            continue                                    # a layer that windows itself
        # the same K/V storage (fp32 or fp8); an fp8 backend's scale has its k_scale folded in
        backend = windowed_backend_cls(old.name)(
            old.num_heads, old.num_kv_heads, old.head_size,
            old.scale / getattr(old, "k_scale", 1.0), old.head_size_v)
        backend.window, backend.rope_inv_freq = window, inv_freq.to(device)
        module.attn = backend
    if plan.from_flags and rotary is not None and not isinstance(rotary, UnboundedRotaryEmbedding):
        model.model.rotary_emb = UnboundedRotaryEmbedding(inner, inv_freq)
    logger.info("attention window: %d of %d layers, %s", sum(w is not None for w in plan.layers),
                len(plan.layers), plan.kv_window or "per layer, no KV freeing")
    return plan
