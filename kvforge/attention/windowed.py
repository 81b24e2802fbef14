"""Paged attention restricted to sinks + a sliding window (``attention/window.py``).

The cache layout is ``paged``'s, keys rotated at their true positions. Each step, per group of
queries, the backend gathers only the keys the group can see, by position, through the block
table (blocks out of every window may have been freed: their table entries are placeholders
and are never read)::

    key columns of one group    [ sinks 0 .. S-1 | window lo .. hi ]
        decodes (Q = 1 each):    lo = p - W + 1 (columns below S or below 0 are padding)
        prefill tile [a, b):     lo = max(S, p0 + a - W + 1), hi = p0 + b - 1
    slot of position k  = block_table[k // B] * B + k % B       (padding -> slot 0, masked)

then runs one ``scaled_dot_product_attention`` per group with an additive float mask (0 or
-inf, shared by every head). Decodes under a window without sinks (Gemma 3's local layers)
skip the gather: the compiled paged kernel reads each row's last ``window`` keys in place.
With StreamingLLM positions, once a query is past S + W - 1 its sink scores must use the
query rotated back by ``sink_shift(p)``:

- decodes (one query per sequence): the sequence's sink keys are rotated forward by its shift
  instead (same score: RoPE is a rotation, q . R(d) k = R(-d) q . k);
- prefill tiles (a different shift per query): the sink scores are computed on the side and
  carried by a per-head mask whose sink columns hold them, the sink keys zeroed (q . 0 = 0):

      mask[h, i, c] = score(q_i rotated back, sink c)   c < sink_cols
                      0 or -inf (visible or not)         c >= sink_cols

cos/sin of the shifts are computed once per step in float64 (exact at any position). Prefill
chunks run in query tiles of ``query_tile`` rows, so a tile reads at most S + W + tile - 1
keys whatever the context. A layer whose ``window`` is None (a full-attention layer of a
partly windowed model) is plain ``paged`` attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvforge.attention.base import get_backend_cls, register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import _SDPA_HAS_GQA, PagedAttentionBackend, write_kv_cache
from kvforge.attention.window import AttentionWindow
from kvforge.attention.prompt_tiles import prompt_attention
from kvforge.kernels import ops as kernel_ops
from kvforge.layers.prompt_rows import computing_prompt_rows


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for ``positions [...]`` (may be negative): ``[cos | cos]`` and
    ``[-sin | sin]``, each ``[..., 2 * len(inv_freq)]``. Angles ``position * inv_freq`` in
    float64 (a shift of 10^9 positions stays exact to ~1e-7 rad), then cast to ``dtype``."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(positions.device, torch.float64)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE rotation in the rotate_half layout of ``layers/rotary.py``, with ``rope_cos_sin``
    tables broadcast to ``x[..., :rotary_dim]`` (dims past it are not rotated)::

        x = [x1 | x2]:  x * [cos | cos] + [x2 | x1] * [-sin | sin]
                        = [x1 cos - x2 sin | x2 cos + x1 sin]
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:               # three ops: this runs per layer
        return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)
    part = x[..., :rot]
    rotated = torch.addcmul(part * cos, part.roll(rot // 2, dims=-1), sin)
    return torch.cat([rotated, x[..., rot:]], dim=-1)


def rotate_half_layout(x: torch.Tensor, positions: torch.Tensor,
                       inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, D]`` by ``positions [...]`` (may be negative)."""
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    return rotate(x, cos[..., None, :], sin[..., None, :])


@dataclass
class _Group:
    """Queries ``rows`` (n sequences x Q each, contiguous in the batch) and the keys they read."""
    rows: slice
    n: int
    q_len: int
    key_slots: torch.Tensor          # [n * L] slot of each key column
    visible: torch.Tensor            # [n, 1, Q, L] bool
    sink_cols: int                   # the first sink_cols columns are sinks
    sink_shift: torch.Tensor | None  # [n, Q] rotate the query back by this for the sink columns
    # per dtype, built by the first layer that needs them: additive mask, shift cos/sin
    cache: dict = field(default_factory=dict)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        key = ("mask", dtype)
        if key not in self.cache:
            self.cache[key] = torch.zeros(self.visible.shape, dtype=dtype,
                                          device=self.visible.device).masked_fill_(
                                              ~self.visible, float("-inf"))
        return self.cache[key]

    def shift_cos_sin(self, inv_freq: torch.Tensor, dtype: torch.dtype):
        """RoPE tables of the shift: decodes rotate their sink keys forward ([n, 1, 1, rot]),
        prefill tiles their queries back ([1, 1, Q, rot])."""
        key = ("rot", dtype)
        if key not in self.cache:
            if self.q_len == 1:
                cos, sin = rope_cos_sin(self.sink_shift[:, 0], inv_freq, dtype)
                self.cache[key] = cos[:, None, None], sin[:, None, None]
            else:
                cos, sin = rope_cos_sin(-self.sink_shift[0], inv_freq, dtype)
                self.cache[key] = cos[None, None], sin[None, None]
        return self.cache[key]


def _slots(block_tables: torch.Tensor, seq_idx: torch.Tensor, key_pos: torch.Tensor,
           valid: torch.Tensor, block_size: int) -> torch.Tensor:
    pos = key_pos.clamp(min=0)
    slots = block_tables[seq_idx, pos // block_size] * block_size + pos % block_size
    return torch.where(valid, slots, torch.zeros_like(slots))


def _decode_group(meta: AttentionMetadata, window: AttentionWindow) -> _Group:
    n, device = meta.num_decodes, meta.block_tables.device
    longest = max(meta.seq_lens_list[:n])
    sink_cols, win_cols = min(window.sinks, longest), min(window.window, longest)
    query_pos = meta.seq_lens[:n] - 1                                         # [n]
    cols = torch.arange(sink_cols + win_cols, device=device)
    is_sink = cols < sink_cols
    key_pos = torch.where(is_sink, cols, query_pos[:, None] - win_cols + 1 + (cols - sink_cols))
    # a position below S is read through the sink columns only
    valid = (key_pos >= 0) & (is_sink | (key_pos >= window.sinks))
    visible = valid & window.visible(query_pos[:, None], key_pos)            # [n, L]
    seq_idx = torch.arange(n, device=device)[:, None]
    slots = _slots(meta.block_tables, seq_idx, key_pos, visible, meta.block_size)
    shift = (window.sink_shift(query_pos)[:, None]
             if window.max_sink_shift(longest - 1) and sink_cols else None)
    return _Group(slice(0, n), n, 1, slots.reshape(-1), visible[:, None, None, :],
                  sink_cols, shift)


def _prefill_groups(meta: AttentionMetadata, window: AttentionWindow, seq: int, t0: int,
                    tile: int) -> list[_Group]:
    device = meta.block_tables.device
    query_len = meta.query_lens_list[seq]
    first = meta.seq_lens_list[seq] - query_len                               # p0
    groups = []
    for a in range(0, query_len, tile):
        b = min(query_len, a + tile)
        sink_cols = min(window.sinks, first + b)
        lo, hi = max(window.sinks, first + a - window.window + 1), first + b - 1
        # (no window columns while the tile's last query is still among the sinks: p < S)
        key_pos = torch.cat([torch.arange(sink_cols, device=device),
                             torch.arange(lo, max(lo, hi + 1), device=device)])  # [L]
        query_pos = torch.arange(first + a, first + b, device=device)         # [Q]
        visible = window.visible(query_pos[:, None], key_pos[None, :])        # [Q, L]
        slots = _slots(meta.block_tables, torch.tensor(seq, device=device), key_pos,
                       torch.ones_like(key_pos, dtype=torch.bool), meta.block_size)
        shift = (window.sink_shift(query_pos)[None]
                 if window.max_sink_shift(first + b - 1) and sink_cols else None)
        groups.append(_Group(slice(t0 + a, t0 + b), 1, b - a, slots, visible[None, None],
                             sink_cols, shift))
    return groups


def _build_groups(meta: AttentionMetadata, window: AttentionWindow, tile: int,
                  decodes: bool = True) -> list[_Group]:
    """The step's groups; ``decodes=False``: the prefill tiles only (the decodes ran in the
    compiled kernel)."""
    groups = [_decode_group(meta, window)] if meta.num_decodes and decodes else []
    t0 = meta.num_decodes
    for seq in range(meta.num_decodes, meta.num_seqs):
        if meta.query_lens_list[seq]:
            groups.extend(_prefill_groups(meta, window, seq, t0, tile))
        t0 += meta.query_lens_list[seq]
    return groups


@register_backend("windowed")
class WindowedAttentionBackend(PagedAttentionBackend):
    """Paged attention over sinks + a sliding window.

    ``window`` (None: full causal attention, exactly ``paged``) and ``rope_inv_freq`` (the
    model's RoPE frequencies, needed when ``window.shifts_sinks``) are set per layer after the
    model is built, by ``attention/window_setup.configure_attention_window``.
    """

    window: AttentionWindow | None = None
    rope_inv_freq: torch.Tensor | None = None
    query_tile: int = 256

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        window = self.window
        if window is None:
            return super().forward(q, k, v, kv_cache, meta)
        if window.shifts_sinks and self.rope_inv_freq is None:
            raise ValueError("StreamingLLM sink positions need the model's RoPE frequencies "
                             "(rope_inv_freq); configure the backend with "
                             "configure_attention_window")
        self._store(q, k, v, kv_cache, meta)
        out = q.new_empty(q.shape[0], self.num_heads, self.head_size_v)
        if computing_prompt_rows() and not window.sinks:
            # a plain sliding window (Gemma 3's local layers): fixed tiles, as paged's prompt
            # rows (sinks, whose scores may shift per query, keep the groups below)
            prompt_attention(self, q, kv_cache, meta, window.window, out)
            return out
        # decodes under a plain sliding window (no sinks: Gemma 3's local layers): the compiled
        # kernel reads each row's last `window` keys in place, no gather, no mask
        kernel_decodes = meta.num_decodes > 0 and window.sinks == 0 and self._window_decodes(
            q, kv_cache, meta, window.window, out)
        # built by the first layer, shared by every layer with the same window (metadata is
        # rebuilt every step)
        plans = meta.__dict__.setdefault("_window_plans", {})
        key = (window, self.query_tile, kernel_decodes)
        if key not in plans:
            plans[key] = _build_groups(meta, window, self.query_tile,
                                       decodes=not kernel_decodes)
        for group in plans[key]:
            self._attend(q, kv_cache, group, out)
        return out

    def _store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """Check the shapes and write the step's K/V (``windowed_quest``: QUEST's layout)."""
        self._check_inputs(q, k, v, kv_cache, meta)
        write_kv_cache(kv_cache, k, v, meta.slot_mapping)

    def _window_decodes(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        window: int, out: torch.Tensor) -> bool:
        """The decode rows through the compiled kernel's window; False where it does not apply
        (the caller then gathers and runs SDPA)."""
        n = meta.num_decodes
        attn = kernel_ops.paged_decode_attention(q[:n], kv_cache[0], kv_cache[1],
                                                 meta.block_tables[:n], meta.seq_lens[:n],
                                                 self.scale, window)
        if attn is None:
            return False
        out[:n] = attn
        return True

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, g: _Group,
                out: torch.Tensor) -> None:
        kvh, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        n, q_len, cols = g.n, g.q_len, g.sink_cols
        dtype = q.dtype
        # [n * L] slots -> [n, L, KVH, D] -> [n, KVH, L, D] (fresh tensors: safe to edit)
        keys, values = self._gather_kv(kv_cache, g.key_slots)
        keys = keys.to(dtype).view(n, -1, kvh, self.head_size).transpose(1, 2)
        values = values.to(dtype).view(n, -1, kvh, self.head_size_v).transpose(1, 2)
        queries = q[g.rows].view(n, q_len, self.num_heads, self.head_size).transpose(1, 2)
        mask = g.mask(dtype)                                                  # [n, 1, Q, L]
        if g.sink_shift is not None:
            cos, sin = g.shift_cos_sin(self.rope_inv_freq, dtype)
            if q_len == 1:
                keys[:, :, :cols] = rotate(keys[:, :, :cols], cos, sin)
            else:
                back = rotate(queries, cos, sin)                              # [1, H, Q, D]
                sink_keys = keys[:, :, :cols].repeat_interleave(group, dim=1)   # [1, H, S, D]
                mask = mask.expand(n, self.num_heads, -1, -1).clone()
                mask[..., :cols] += torch.matmul(back, sink_keys.transpose(-1, -2)) * self.scale
                keys[:, :, :cols] = 0
        if group > 1 and not _SDPA_HAS_GQA:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale,
            **({"enable_gqa": True} if group > 1 and _SDPA_HAS_GQA else {}))  # [n, H, Q, Dv]
        out[g.rows] = attn.transpose(1, 2).reshape(n * q_len, self.num_heads, -1)


def windowed_backend_cls(backend: str) -> type[WindowedAttentionBackend]:
    """The windowed backend that stores K/V as ``backend`` does: "paged" (fp32) or
    "paged_fp8_*" (``quant/fp8_kv.py``); ValueError for another cache layout (tiled, QUEST)."""
    if backend == "paged":
        return WindowedAttentionBackend
    if backend.startswith("paged_fp8_"):
        return get_backend_cls("windowed_" + backend[len("paged_"):])
    raise ValueError(f"sliding-window attention runs on the paged KV layout (fp32 or fp8 "
                     f"K/V); attention_backend={backend!r} is not supported")
