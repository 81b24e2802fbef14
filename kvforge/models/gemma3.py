"""Gemma 3 text decoder (HF ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``; GGUF
``gemma3``). Same projections as Llama; what differs, all from HF's ``modeling_gemma3``:

    h = embed(ids) * sqrt(hidden)
    per layer:  a = post_attention_norm(attn(input_norm(h)));      h = h + a
                m = post_feedforward_norm(mlp(pre_feedforward_norm(h)));   h = h + m
    logits = lm_head(norm(h)), optionally soft-capped: cap * tanh(logits / cap)

  - every norm is ``OffsetRMSNorm`` (scale ``1 + weight``; checkpoints store the weight
    zero-centred), including the per-head q/k norms applied before RoPE
  - MLP: gelu-tanh(gate) * up; attention scale ``query_pre_attn_scalar ** -0.5``
  - layers alternate: ``sliding_attention`` layers (5 of every 6 by default) see only the last
    ``sliding_window`` positions (the query included) and use RoPE base 10k;
    ``full_attention`` layers see everything and use the global base (1e6, maybe scaled)

The sliding layers carry their window in their attention backend (``WindowedAttentionBackend``
with a true-position window over the normal paged cache, no blocks freed), so the model is
exact on its own, with or without an engine; the engine's window planning leaves them alone
(``applies_own_sliding_window``), and StreamingLLM flags (``--attention-sinks S
--sliding-window W``, W at least the local window) window the full layers with sinks + W at
in-cache positions (global RoPE), so generation can pass the context with bounded KV. With
QUEST (``--sparse-attention quest``) the full-attention layers decode over the top blocks by
QUEST's bound and the sliding layers keep their window over QUEST's cache layout
(``attention/quest.WindowedQuestBackend``). Decode steps run in the compiled decode stack
(``kernels/decode_stack.py``: the q/k and output norms, gelu-tanh and each layer's window,
sinks and RoPE base are options of its layer; QUEST's selection too), with multi-step greedy
decoding; prefill and anything the stack does not take (verification rows under QUEST) run
the Python layers below, the reference.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from kvforge.attention.base import Attend, get_backend_cls
from kvforge.attention.quest import WindowedQuestBackend
from kvforge.attention.window import AttentionWindow
from kvforge.attention.windowed import windowed_backend_cls
from kvforge.layers.embedding import uninitialized_embedding
from kvforge.layers.linear import Linear, MergedLinear, UnquantizedLinearMethod
from kvforge.layers.norm import OffsetRMSNorm
from kvforge.layers.rotary import ComputedRotaryEmbedding, cos_sin_rows
from kvforge.models.base import PagedKVModelMixin, expected_weight_keys, finish_loading
from kvforge.models.compiled_decode import CompiledDecodeMixin
from kvforge.models.config import ModelConfig
from kvforge.models.llama import LlamaForCausalLM, LlamaMLP

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_SLIDING_PATTERN = 6                    # HF: every 6th layer is global
DEFAULT_LOCAL_ROPE_BASE = 10_000.0             # not in GGUF files: llama.cpp hard-codes it too
DEFAULT_GLOBAL_ROPE_BASE = 1_000_000.0


@dataclass(frozen=True)
class Gemma3Options:
    """The Gemma 3 hyper-parameters ``ModelConfig`` does not model, read from the raw HF dict
    (config.json of transformers 4.x or 5.x, or the loader's translation of GGUF metadata)."""

    layer_types: tuple[str, ...]
    sliding_window: int
    local_rope_base: float
    global_rope_base: float
    global_rope_scaling: dict[str, Any] | None
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    hidden_activation: str
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: ModelConfig) -> "Gemma3Options":
        hf = config.hf_config
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if hf.get(key):
                raise ValueError(f"Gemma 3 with {key}={hf[key]!r} is not supported (no released "
                                 f"Gemma 3 causal LM sets it)")
        n = config.num_hidden_layers
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern",
                                                              DEFAULT_SLIDING_PATTERN))
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        if len(layer_types) != n or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {n} of {SLIDING!r} / {FULL!r}, "
                             f"got {layer_types!r}")
        window = hf.get("sliding_window")
        if SLIDING in layer_types and (not isinstance(window, int) or window < 1):
            raise ValueError(f"Gemma 3 sliding layers need a positive sliding_window, "
                             f"got {window!r}")
        # transformers 5 nests RoPE per layer type; 4.x has rope_theta / rope_local_base_freq
        params = hf.get("rope_parameters") or {}
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
        global_base = full.pop("rope_theta", None) or hf.get("rope_theta") or \
            DEFAULT_GLOBAL_ROPE_BASE
        scaling = full if full.get("rope_type", "default") != "default" else hf.get("rope_scaling")
        local_base = (local.get("rope_theta") or hf.get("rope_local_base_freq")
                      or DEFAULT_LOCAL_ROPE_BASE)
        softcap = hf.get("final_logit_softcapping")
        return cls(
            layer_types=tuple(layer_types),
            sliding_window=int(window or 0),
            local_rope_base=float(local_base),
            global_rope_base=float(global_base),
            global_rope_scaling=scaling or None,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or config.head_dim),
            final_logit_softcapping=float(softcap) if softcap else None,
            hidden_activation=hf.get("hidden_activation") or hf.get("hidden_act")
            or "gelu_pytorch_tanh",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelConfig, options: Gemma3Options, layer_type: str,
                 attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.layer_type = layer_type
        self.qkv_proj = MergedLinear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                     bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias,
                             dtype=dtype, device=device)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        scale = options.query_pre_attn_scalar ** -0.5
        if layer_type == SLIDING:
            # a layer-local window over the full paged cache (HF: key k is visible to query p
            # iff p - W < k <= p)
            try:
                # fp32 or fp8 K/V; under QUEST (the global layers' sparse decode) the window
                # over QUEST's layout, as every layer shares one cache layout
                windowed = (WindowedQuestBackend if attn_backend == "quest"
                            else windowed_backend_cls(attn_backend))
            except ValueError as e:
                raise ValueError(f"Gemma 3's sliding-window layers: {e}") from None
            self.attn = windowed(self.num_heads, self.num_kv_heads, self.head_dim, scale=scale)
            self.attn.window = AttentionWindow(0, options.sliding_window, "true")
        else:
            self.attn = get_backend_cls(attn_backend)(self.num_heads, self.num_kv_heads,
                                                      self.head_dim, scale=scale)

    def forward(self, hidden: torch.Tensor, rotary: ComputedRotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """q and k normed per head, then rotated; ``attend(q, k, v)`` gives the rows' attention
        output [T, H, D] (the layer's backend over the paged cache, or kvforge/offload's per
        batch over staged KV); then o_proj."""
        out = attend(*self.rotated_qkv(hidden, rotary, cos, sin))
        return self.o_proj(out.reshape(hidden.shape[0], self.q_size))

    def rotated_qkv(self, hidden: torch.Tensor, rotary: ComputedRotaryEmbedding,
                    cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, H, D], k [T, KVH, D], v [T, KVH, D]): q and k normed per head, then rotated
        (also what early exit caches for the layers a row skips: models/layerwise.py)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads,
                                                                  self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return rotary.apply(self.q_norm(q), cos, sin), rotary.apply(self.k_norm(k), cos, sin), v


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: Gemma3Options, layer_type: str,
                 attn_backend: str, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(config, options, layer_type, attn_backend, dtype, device)
        # act(gate) * up -> down, Llama's MLP with Gemma's activation
        self.mlp = LlamaMLP(replace(config, hidden_act=options.hidden_activation), dtype, device)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps, dtype, device)

    def forward(self, hidden, rotary, cos, sin, kv_cache, meta):
        backend = self.self_attn.attn
        return self.forward_attending(hidden, rotary, cos, sin,
                                      lambda q, k, v: backend.forward(q, k, v, kv_cache, meta))

    def forward_attending(self, hidden: torch.Tensor, rotary: ComputedRotaryEmbedding,
                          cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layer with ``attend`` for its attention call (kvforge/offload attends per batch
        on staged KV). No residual stream: each sub-block's output is normed before it is
        added."""
        attn = self.self_attn(self.input_layernorm(hidden), rotary, cos, sin, attend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, options: Gemma3Options, attn_backend: str,
                 dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size,
                                                    dtype, device)
        # HF multiplies by the fp32 scalar sqrt(hidden) cast to the weight dtype
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size)).to(dtype))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, options, layer_type, attn_backend, dtype, device)
            for layer_type in options.layer_types)
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        max_pos = config.max_position_embeddings
        self.rotary_local = ComputedRotaryEmbedding(config.head_dim, options.local_rope_base,
                                                    None, max_pos, device)
        self.rotary_global = ComputedRotaryEmbedding(config.head_dim, options.global_rope_base,
                                                     options.global_rope_scaling, max_pos, device)


class Gemma3ForCausalLM(CompiledDecodeMixin, PagedKVModelMixin, nn.Module):
    # the sliding layers window themselves (see the module docstring): the engine must not
    # plan model windows on top (attention/window_setup.py)
    applies_own_sliding_window = True

    @staticmethod
    def own_attention_windows(config: ModelConfig) -> list[AttentionWindow | None]:
        """Each layer's own window (None: full attention), for the engine's window planning:
        StreamingLLM flags window the full layers and leave these (attention/window_setup.py)."""
        options = Gemma3Options.from_config(config)
        return [AttentionWindow(0, options.sliding_window, "true") if t == SLIDING else None
                for t in options.layer_types]

    def window_rope_inv_freq(self) -> torch.Tensor:
        """The RoPE frequencies of the layers StreamingLLM windows (the full layers' global
        base): what a sink key's score is rotated back with."""
        return self.model.rotary_global.inv_freq

    def __init__(self, config: ModelConfig, attn_backend: str = "paged",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.options = Gemma3Options.from_config(config)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.dtype = dtype
        self.model = Gemma3Model(config, self.options, attn_backend, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                              device=device)
        self._tied = self.options.tie_word_embeddings
        self._head_shares_embedding = (self._tied and
                                       isinstance(self.lm_head.method, UnquantizedLinearMethod))
        if self._head_shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] final-normed hidden states."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {self.num_layers} layers")
        hidden = self._stack_forward(input_ids, positions, kv_caches, meta)
        if hidden is not None:
            return hidden
        model = self.model
        hidden = model.embed_tokens(input_ids) * model.embed_scale
        dtype = hidden.dtype
        # one cos/sin per RoPE base per step, shared by the layers of that type
        tables = {SLIDING: (model.rotary_local, *model.rotary_local.cos_sin(positions, dtype)),
                  FULL: (model.rotary_global, *model.rotary_global.cos_sin(positions, dtype))}
        for layer, kv_cache in zip(model.layers, kv_caches):
            rotary, cos, sin = tables[layer.layer_type]
            hidden = layer(hidden, rotary, cos, sin, kv_cache, meta)
        return model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The config's soft-cap, cap * tanh(logits / cap), or the logits as they are (also
        what the offloaded head and a draft's frequent-token head apply to their products)."""
        cap = self.options.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def first_attention_backend(self):
        return self.model.layers[0].self_attn.attn

    # ------------------------------------------------- the compiled decode stack's hooks
    def _build_decode_stack(self):
        from kvforge.kernels.decode_stack import build_gemma3_decode_stack
        return build_gemma3_decode_stack(self)

    @property
    def _stack_embed_scale(self) -> float:
        return self.model.embed_scale

    @property
    def _stack_greedy_exact(self) -> bool:
        # a soft-cap is monotonic but can round two large logits to one value: the raw argmax
        # might then not be the capped logits' first maximum
        return self.options.final_logit_softcapping is None

    def _stack_step_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor):
        model = self.model
        hidden = model.embed_tokens(input_ids) * model.embed_scale
        num_tokens = input_ids.shape[0]
        rows = [t.reshape(num_tokens, -1) for rotary in (model.rotary_global, model.rotary_local)
                for t in rotary.cos_sin(positions, hidden.dtype)]
        return hidden, tuple(rows)              # cos, sin, cos_local, sin_local

    def _stack_rope_tables(self, positions: torch.Tensor, num_steps: int):
        # rows for the positions the call reaches only: no table of every position
        first, last = int(positions.min()), int(positions.max()) + num_steps - 1
        global_rows, local_rows = (cos_sin_rows(rotary, first, last, positions.device, self.dtype)
                                   for rotary in (self.model.rotary_global,
                                                  self.model.rotary_local))
        return global_rows, local_rows, first

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (zero-centred norm weights, as HF stores them); raises
        ValueError on an unknown name, a bad shape, or a parameter left unloaded."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self._tied:
                continue            # a tied checkpoint may store a copy; the embedding wins
            if name == "model.embed_tokens.weight" and self._tied:
                if not self._head_shares_embedding:
                    self.lm_head.load_weight("weight", tensor)
                loaded.add("lm_head.weight")
            loaded.add(self._load_one(name, tensor))
        finish_loading(self, expected_weight_keys(self), loaded)

    # the HF name routing (q/k/v -> qkv_proj, gate/up -> gate_up_proj) is Llama's
    _load_one = LlamaForCausalLM._load_one
