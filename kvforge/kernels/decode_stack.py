"""Run a pure-decode step of a Llama-family or Gemma 3 model through the compiled ``DecodeStack``.

Eligible: an fp32 model on CPU whose projections are fp32 ``Linear`` weights (packed here for our
kernels, see ``layers/linear.PackedLinearMethod``; the Python layers then use the packed weights
too), GGUF blocks (``quant/gguf.py``: the stack runs their kernels itself) or other quantized
``Linear`` modules (called back: their own int8/int4 kernels), SwiGLU MLPs
without bias, full-width NeoX rotary, paged attention (``PagedAttentionBackend``, or the
windowed one: a native sliding window, StreamingLLM's sinks + window with in-cache positions;
Gemma 3's local layers: their plain window) over a contiguous KV cache of fp32 or fp8 K/V
(``quant/fp8_kv.py`` with unit scales: the stack rounds the new K/V to fp8 as the Python
backends' cast does), or QUEST's backends on every layer (``attention/quest.py``: its fp32
head-major cache, key bounds written by the stack, QUEST's selection on the sparse layers; steps
of one query token per sequence). Anything else returns None and the model runs its Python
layers, which remain the reference (tests compare the two).
"""
from __future__ import annotations

import torch

from kvforge.kernels import cpu_kernels


def _stack_mlp_and_projections_ok(layer, activations: tuple[str, ...]) -> bool:
    """A layer's MLP is Llama's gated one with one of ``activations`` and no bias, and every
    projection is one the stack takes (an fp32 contiguous weight, or any other method, which
    it calls back)."""
    from kvforge.layers.activation import GatedActivation
    from kvforge.layers.linear import UnquantizedLinearMethod
    from kvforge.models.llama import LlamaMLP
    attn, mlp = layer.self_attn, layer.mlp
    if (type(mlp) is not LlamaMLP or not isinstance(mlp.act_fn, GatedActivation)
            or mlp.act_fn.act_name not in activations):
        return False
    if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return False
    return not any(type(p.method) is UnquantizedLinearMethod
                   and (p.weight.dtype != torch.float32 or not p.weight.is_contiguous())
                   for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


def _stack_attention_kind(backend, windowed: bool) -> str | None:
    """How the stack runs ``backend``: "paged" for plain paged attention (``windowed``: a
    windowed one, whose window the caller checks) over fp32 K/V or fp8 K/V with unit scales,
    "quest" for QUEST's backends (their head-major cache); None when it cannot."""
    from kvforge.attention.paged import PagedAttentionBackend
    from kvforge.attention.quest import QuestAttentionBackend, WindowedQuestBackend
    from kvforge.attention.windowed import WindowedAttentionBackend
    from kvforge.quant import fp8_kv
    if type(backend) is (WindowedQuestBackend if windowed else QuestAttentionBackend):
        return "quest"
    allowed = ((WindowedAttentionBackend, fp8_kv.WindowedFP8E4M3Backend,
                fp8_kv.WindowedFP8E5M2Backend) if windowed else
               (PagedAttentionBackend, fp8_kv.PagedFP8E4M3Backend, fp8_kv.PagedFP8E5M2Backend))
    if type(backend) not in allowed:
        return None
    unit = not isinstance(backend, fp8_kv.FP8KVCache) or backend.k_scale == backend.v_scale == 1.0
    return "paged" if unit else None


def _layer_window(backend):
    """A layer's ``AttentionWindow`` (None: every key)."""
    from kvforge.attention.windowed import WindowedAttentionBackend
    return backend.window if isinstance(backend, WindowedAttentionBackend) else None


def _set_windows(stack, windows: list, rotary) -> bool:
    """Give ``stack`` the layers' windows (``AttentionWindow`` or None each); ``rotary``: the
    RoPE the layers with sinks rotate with. False when the stack cannot run them: layers with
    sinks that do not share one window, sinks at true positions."""
    with_sinks = {w for w in windows if w is not None and w.sinks > 0}
    if len(with_sinks) > 1 or any(not w.shifts_sinks for w in with_sinks):
        return False
    stack.set_windows([w.window if w is not None else 0 for w in windows],
                      [w.sinks if w is not None else 0 for w in windows],
                      _sink_rope(rotary, with_sinks.pop()) if with_sinks else None)
    return True


def _sink_rope(rotary, window) -> torch.Tensor | None:
    """cos, sin rows of positions 0 .. S + W - 1, ``[S + W, 2, head_dim]``: where StreamingLLM's
    sinks are scored (attention/window.py: the query at c(p) = min(p, S + W - 1)); None when
    no sinks shift."""
    if window is None or not window.shifts_sinks:
        return None
    from kvforge.layers.rotary import cos_sin_rows
    return cos_sin_rows(rotary, 0, window.span - 1).float()


def _window_rotary(model):
    """The RoPE module of the layers StreamingLLM's sinks shift in (Gemma 3: the global one)."""
    inner = model.model
    return inner.rotary_global if hasattr(inner, "rotary_global") else inner.rotary_emb


def configure_stack_attention(stack, model) -> bool:
    """Give ``stack`` the model's current attention windows and QUEST settings (the builders,
    and ``sync_stack_attention`` after they change); False when it cannot run them."""
    backends = [layer.self_attn.attn for layer in model.model.layers]
    if not _set_windows(stack, [_layer_window(b) for b in backends], _window_rotary(model)):
        return False
    _configure_quest(stack, backends)
    return True


def sync_stack_attention(model) -> None:
    """After the attention backends' windows or QUEST settings change on a built model
    (``eval/long_nll.set_window``, ``attention/quest.configure_quest``): its compiled stack, if
    built, takes the new ones, or is dropped where it cannot run them (the Python layers do)."""
    if getattr(model, "_decode_stack_built", False) and model._decode_stack is not None:
        if not configure_stack_attention(model._decode_stack, model):
            model._decode_stack = None


def _configure_quest(stack, backends: list) -> None:
    """QUEST on the stack when the layers' backends are QUEST's (``_stack_attention_kind``
    "quest" for every layer; the caller checked they agree): which layers select blocks, and
    the budget ``configure_quest`` gave them."""
    from kvforge.attention.quest import QuestAttentionBackend
    quest = [b for b in backends if isinstance(b, QuestAttentionBackend)]
    if not quest:
        return
    budgets = {b.token_budget for b in quest}
    if len(budgets) != 1:
        raise ValueError(f"QUEST backends with different token budgets: {sorted(budgets)}")
    stack.set_quest([isinstance(b, QuestAttentionBackend) and b.is_sparse_layer
                     for b in backends], budgets.pop())


def _stack_projections(model) -> list[tuple]:
    """Per layer ((qkv, bias), (o, bias), (gate_up, _), (down, _)) as the stack takes them,
    the fp32 weights first moved into one huge-page buffer in the order a step reads them.
    The packed panels are even with row-major at 1-8 rows and faster from 16 (linear.cpp): an
    engine that verifies speculated tokens (up to 8 rows a step) keeps the model's row-major
    weights (``pack_decode_weights``), whose few-row tiles were tuned for it."""
    from kvforge.layers.linear import place_linears
    layers = model.model.layers
    place_linears([p for layer in layers
                   for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                             layer.mlp.gate_up_proj, layer.mlp.down_proj)],
                  pack=model.pack_decode_weights)
    empty = torch.Tensor()

    def projection(linear):
        """What the stack multiplies by (``kernel_weight``) and the bias; a quantized layer
        without one of our kernels: the module itself (called back)."""
        bias = linear.bias if linear.bias is not None else empty
        weight = kernel_weight(linear)
        return (linear, empty) if weight is None else (weight, bias)

    return [tuple(projection(p) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                          layer.mlp.gate_up_proj, layer.mlp.down_proj))
            for layer in layers]


def build_llama_decode_stack(model):
    """A ``DecodeStack`` over ``model``'s own weight tensors, or None when not eligible."""
    ops = cpu_kernels()
    if ops is None or model.dtype != torch.float32:
        return None
    inner = model.model
    rotary = inner.rotary_emb
    if rotary.rotary_dim != rotary.head_dim or rotary.cos_sin_table.device.type != "cpu":
        return None
    from kvforge.attention.windowed import WindowedAttentionBackend
    norm_eps, kinds = None, set()
    for layer in inner.layers:
        backend = layer.self_attn.attn
        kinds.add(_stack_attention_kind(backend,
                                        windowed=isinstance(backend, WindowedAttentionBackend)))
        if None in kinds or len(kinds) > 1 or not _stack_mlp_and_projections_ok(
                layer, ("silu", "swish")):
            return None
        eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps, inner.norm.eps}
        if len(eps) != 1 or (norm_eps is not None and eps != {norm_eps}):
            return None
        norm_eps = eps.pop()

    layers = []
    for layer, ((qkv, qkv_bias), (o, o_bias), (gate_up, _), (down, _)) in zip(
            inner.layers, _stack_projections(model)):
        layers.append([layer.input_layernorm.weight, qkv, qkv_bias, o, o_bias,
                       layer.post_attention_layernorm.weight, gate_up, down])
    first = inner.layers[0].self_attn
    stack = ops.DecodeStack(layers, inner.norm.weight, float(norm_eps), first.num_heads,
                            first.num_kv_heads, first.head_dim, float(first.attn.scale))
    return stack if configure_stack_attention(stack, model) else None


def build_gemma3_decode_stack(model):
    """A ``DecodeStack`` over a Gemma 3 model's weights (models/gemma3.py), or None when not
    eligible: the Llama conditions (fp32, our kernels' weights or called-back modules, no MLP
    bias, one norm epsilon) plus the paged backends (sliding layers: a plain window, no sinks),
    full-width rotation and the gelu-tanh gate. Gemma's norms scale by 1 + w: the stack gets
    that sum, computed in fp32 as the Python layers do."""
    from kvforge.models.gemma3 import SLIDING

    ops = cpu_kernels()
    if ops is None or model.dtype != torch.float32:
        return None
    inner = model.model
    first = inner.layers[0].self_attn
    for rotary in (inner.rotary_local, inner.rotary_global):
        if rotary.head_dim != first.head_dim or rotary.inv_freq.device.type != "cpu":
            return None
    from kvforge.attention.windowed import WindowedAttentionBackend
    eps_all, kinds, windows = set(), set(), []
    for layer in inner.layers:
        attn = layer.self_attn
        backend = attn.attn
        kinds.add(_stack_attention_kind(
            backend, windowed=isinstance(backend, WindowedAttentionBackend)))
        if None in kinds or len(kinds) > 1:     # one cache layout for every layer
            return None
        # the sliding layers' own window; a full layer's StreamingLLM window (engine flags)
        windows.append(_layer_window(backend))
        if layer.layer_type == SLIDING and (windows[-1] is None or windows[-1].sinks != 0):
            return None
        if not _stack_mlp_and_projections_ok(layer, ("gelu_pytorch_tanh", "gelu_new")):
            return None
        eps_all |= {n.eps for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                    layer.pre_feedforward_layernorm,
                                    layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm)}
    eps_all.add(inner.norm.eps)
    if len(eps_all) != 1:
        return None

    def scale(norm):                      # OffsetRMSNorm: 1 + w in fp32, as its forward
        return (1.0 + norm.weight.detach().float()).contiguous()

    layers, extras = [], []
    for layer, ((qkv, qkv_bias), (o, o_bias), (gate_up, _), (down, _)) in zip(
            inner.layers, _stack_projections(model)):
        attn = layer.self_attn
        layers.append([scale(layer.input_layernorm), qkv, qkv_bias, o, o_bias,
                       scale(layer.pre_feedforward_layernorm), gate_up, down])
        sliding = layer.layer_type == SLIDING
        window = _layer_window(attn.attn)
        # rope 1: the local base (forward's cos_local / generate's cos_sin_local)
        extras.append([scale(attn.q_norm), scale(attn.k_norm),
                       scale(layer.post_attention_layernorm),
                       scale(layer.post_feedforward_layernorm),
                       window.window if window is not None else 0, 1 if sliding else 0])
    stack = ops.DecodeStack(layers, scale(inner.norm), float(eps_all.pop()), first.num_heads,
                            first.num_kv_heads, first.head_dim, float(first.attn.scale),
                            activation=1, extras=extras)
    # the windows again with StreamingLLM's sinks (the full layers, the global RoPE); QUEST
    return stack if configure_stack_attention(stack, model) else None


def kernel_weight(linear):
    """A ``Linear``'s weight as ``DecodeStack`` takes it: (packed weight, out_features) when
    packed, the fp32 [out, in] tensor, the ``GgufWeight`` of GGUF blocks; None for any other
    method (the stack calls such a layer back as a module)."""
    from kvforge.layers.linear import PackedLinearMethod, UnquantizedLinearMethod
    from kvforge.quant.gguf import GGUFLinearMethod
    method = linear.method
    if type(method) is PackedLinearMethod:
        return linear.packed_weight, linear.output_size
    if type(method) is UnquantizedLinearMethod and linear.weight.dtype == torch.float32:
        return linear.weight
    if isinstance(method, GGUFLinearMethod):
        return method.kernel_weight
    return None


# Longest query run per sequence the stack takes: decodes (1) and speculative verification
# (1 + k). Its attention loops over keys per query token, fine for a few tokens; prefill chunks
# belong to SDPA's tiled kernels.
MAX_QUERY_LEN = 16


def stack_query_limit(stack) -> int:
    """Longest query run per sequence ``stack`` takes: QUEST's stack one (decodes; a
    verification row's keys would be chosen for it alone, where QUEST's backend attends
    densely), any other ``MAX_QUERY_LEN``."""
    return 1 if stack.quest else MAX_QUERY_LEN


def stack_handles_step(meta, stack=None) -> bool:
    """Whether ``stack`` takes this step (None: whether any stack could, before building one)."""
    limit = MAX_QUERY_LEN if stack is None else stack_query_limit(stack)
    return meta.num_seqs > 0 and max(meta.query_lens_list) <= limit


def run_decode_stack(stack, model, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[torch.Tensor], meta) -> torch.Tensor:
    """[T] token ids -> [T, hidden] final-normed hidden states (``model``: a
    ``CompiledDecodeMixin``, which embeds the rows and gives the step's RoPE rows).

    The kernel attends per query token. A sequence with several query tokens (verification of
    speculated tokens) gives each its own row: its sequence's block table, and a length that
    stops at the token itself, which is the causal mask::

        seq 0: context 5, queries at positions 5 6 7  ->  lens 6 7 8, tables row 0 three times
    """
    hidden, ropes = model._stack_step_inputs(input_ids, positions)
    if meta.num_decodes == meta.num_seqs:                          # one token per sequence
        tables, lens = meta.block_tables, meta.seq_lens
    else:
        seq_of_token = torch.repeat_interleave(
            torch.arange(meta.num_seqs, device=input_ids.device),
            torch.tensor(meta.query_lens_list, device=input_ids.device))
        tables, lens = meta.block_tables.index_select(0, seq_of_token), positions + 1
    return stack.forward(hidden, kv_caches, meta.slot_mapping, tables, lens, *ropes)
