"""QUEST query-aware sparse attention (Tang et al., ICML 2024) over the paged cache.

Every KV block keeps, per KV head, the element-wise min and max of its keys. For a decode query
q the largest score any key of a block can reach is bounded by

    bound(block) = sum_d max(q_d * min_d, q_d * max_d) = q+ . max + q- . min
                   (q+ = max(q, 0), q- = min(q, 0))

The heads of a GQA group share their KV head's blocks, so their bounds are summed; since the
bound is linear in q+ and q-, that is (sum_g q_g+) . max + (sum_g q_g-) . min: one pass over
the bounds per KV head, whatever the group size. Decode attends only over the ``token_budget // block_size`` blocks with the
largest bound (the sequence's current, last block always among them); prefill chunks and the
first ``dense_layers`` layers stay dense, as in the paper.

Cache layout: ``kv_cache_shape`` is head-major, with one bounds row per KV head after the
slots of each block::

    kv_cache  [2, num_blocks, num_kv_heads * block_size + num_kv_heads, head_size]
    block b, plane 0:  [ head 0: k0 .. k(B-1) | head 1: k0 .. k(B-1) | ... | kmin h0 h1 .. ]
             plane 1:  [ head 0: v0 .. v(B-1) | head 1: v0 .. v(B-1) | ... | kmax h0 h1 .. ]
    row of (KV head h, slot o) = h * B + o;   row of head h's bound = KVH * B + h

Head-major because a sparse decode reads the chosen blocks of ONE KV head: each is a contiguous
B x D run (4 KiB for SmolLM2) that streams like a dense read, where the token-major paged
layout gives D-float pieces a whole token row apart. The bounds of all heads sit together, so
the bound pass reads one KVH x D run per block and plane. ``kv_slots`` views the slots in the
paged backend's [2, num_blocks, B, KVH, D] order (strided), so dense decode and prefill reuse
``paged``; ``key_bounds`` views the min/max rows.

Keeping the bounds inside the layer's one tensor means copy-on-write block copies (the runner
copies ``cache[:, dst] = cache[:, src]``) carry them along, and nothing else has to be
allocated or freed. Bounds are recomputed from scratch for every block a step writes into, over
slots ``0 .. last slot written``: a reused block (freed, then allocated again) starts over
when its slot 0 is written, stale slots past the written ones are never included, and chunked
prefill, copy-on-write and speculative rollback (a rewrite) all give exact bounds.
A memory-sized pool counts the bounds rows: ``kv_cache_bytes_per_block`` of the model is the
bytes of this shape for one block (B + 1 rows per KV head and plane).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.attention.base import AttentionBackend, register_backend
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.paged import PagedAttentionBackend
from kvforge.attention.windowed import WindowedAttentionBackend
from kvforge.kernels import ops as kernel_ops


@dataclass
class _BlockWrites:
    """Which blocks one step writes into, shared by every layer (cached on the metadata)."""
    blocks: torch.Tensor        # [T] block id of each new token
    offsets: torch.Tensor       # [T] slot within its block
    touched: torch.Tensor       # [U] distinct blocks written
    filled: torch.Tensor        # [U, B] bool: slot holds a token (<= the last slot written)


def _block_writes(meta: AttentionMetadata) -> _BlockWrites:
    cached = meta.__dict__.get("_quest_writes")
    if cached is None:
        size = meta.block_size
        blocks, offsets = meta.slot_mapping // size, meta.slot_mapping % size
        touched, inverse = torch.unique(blocks, return_inverse=True)
        last = torch.zeros_like(touched).scatter_reduce_(0, inverse, offsets, "amax",
                                                         include_self=False)
        filled = torch.arange(size, device=blocks.device)[None, :] <= last[:, None]
        cached = meta.__dict__["_quest_writes"] = _BlockWrites(blocks, offsets, touched, filled)
    return cached


def kv_slots(kv_cache: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The K/V slots of a QUEST cache in the paged order [2, num_blocks, B, KVH, D] (a view)."""
    two, num_blocks, rows, dim = kv_cache.shape
    size = rows // num_kv_heads - 1
    return kv_cache[:, :, :num_kv_heads * size].view(two, num_blocks, num_kv_heads, size,
                                                      dim).transpose(2, 3)


def key_bounds(kv_cache: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's key (min, max), each [num_blocks, KVH, D] (views)."""
    return kv_cache[0, :, -num_kv_heads:], kv_cache[1, :, -num_kv_heads:]


def write_kv_and_bounds(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        meta: AttentionMetadata) -> None:
    """Write the step's K/V into their slots, then recompute the key min/max row of every block
    written (over its filled slots only)."""
    w = _block_writes(meta)
    slots = kv_slots(kv_cache, k.shape[1])
    slots[0].index_put_((w.blocks, w.offsets), k.to(kv_cache.dtype))
    slots[1].index_put_((w.blocks, w.offsets), v.to(kv_cache.dtype))
    keys = slots[0, w.touched]                                            # [U, B, KVH, D]
    empty = ~w.filled[:, :, None, None]
    key_min, key_max = key_bounds(kv_cache, k.shape[1])
    key_min[w.touched] = keys.masked_fill(empty, float("inf")).amin(dim=1)
    key_max[w.touched] = keys.masked_fill(empty, float("-inf")).amax(dim=1)


def block_bounds(queries: torch.Tensor, key_min: torch.Tensor,
                 key_max: torch.Tensor) -> torch.Tensor:
    """QUEST upper bounds, summed over each KV head's query group.

    queries [n, KVH, G, D]; key_min / key_max [n, M, KVH, D] (M blocks per sequence)
    -> [n, KVH, M] float32.
    """
    q = queries.float()
    q_pos = q.clamp(min=0).sum(dim=2)[:, None]                            # [n, 1, KVH, D]
    q_neg = q.clamp(max=0).sum(dim=2)[:, None]
    # elementwise then a sum over D: M x KVH dot products of length D (a batched matmul would
    # first need the bounds permuted to [n, KVH, D, M], a copy as large as this)
    bounds = (key_max.float() * q_pos).sum(-1) + (key_min.float() * q_neg).sum(-1)   # [n, M, KVH]
    return bounds.transpose(1, 2)


def select_blocks(bounds: torch.Tensor, num_blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Logical block indices [n, KVH, k] with the largest bound per (sequence, KV head).

    bounds [n, KVH, M]; num_blocks [n] real blocks per sequence (columns past it are padding
    and only chosen when a sequence has fewer than k blocks); the last real block, the one the
    current token lives in, is always chosen.
    """
    n, _, max_blocks = bounds.shape
    cols = torch.arange(max_blocks, device=bounds.device)
    scores = bounds.masked_fill((cols[None, :] >= num_blocks[:, None])[:, None, :], float("-inf"))
    current = (cols[None, :] == (num_blocks - 1)[:, None])[:, None, :]
    scores = scores.masked_fill(current, float("inf"))
    return scores.topk(k, dim=-1).indices


def store_quest_kv(backend: PagedAttentionBackend, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Check the shapes, write the step's K/V and the bounds of the blocks written; returns the
    slots in the paged order (``kv_slots``, a strided view)."""
    size = meta.block_size
    if kv_cache.dim() != 4 or kv_cache.shape[2:] != (backend.num_kv_heads * (size + 1),
                                                      backend.head_size):
        raise ValueError(f"quest kv_cache shape {tuple(kv_cache.shape)}, expected "
                         f"[2, num_blocks, {backend.num_kv_heads * (size + 1)}, "
                         f"{backend.head_size}]")
    slots = kv_slots(kv_cache, backend.num_kv_heads)
    backend._check_inputs(q, k, v, slots, meta)
    ops = kernel_ops.cpu_kernels()
    if (ops is not None and kv_cache.dtype == torch.float32 and k.dtype == torch.float32
            and kv_cache.is_cpu and kv_cache.is_contiguous() and k.stride(2) == 1
            and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]):
        ops.quest_write(kv_cache, k, v, meta.slot_mapping)      # csrc/quest.cpp, same rule
    else:
        write_kv_and_bounds(kv_cache, k, v, meta)
    return slots


def quest_cache_shape(backend: PagedAttentionBackend, num_blocks: int,
                      block_size: int) -> tuple[int, ...]:
    if backend.head_size_v != backend.head_size:
        raise NotImplementedError("quest needs equal K and V head sizes")
    return (2, num_blocks, backend.num_kv_heads * (block_size + 1), backend.head_size)


@register_backend("quest")
class QuestAttentionBackend(PagedAttentionBackend):
    """Paged attention whose decodes read only the top blocks by the QUEST bound.

    ``token_budget``, ``dense_layers`` and ``layer_idx`` are set per model by
    ``configure_quest`` (layer_idx None: treat as a sparse layer, for unit tests).
    """

    token_budget: int = 2048
    dense_layers: int = 2
    layer_idx: int | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return quest_cache_shape(self, num_blocks, block_size)

    @property
    def is_sparse_layer(self) -> bool:
        return self.layer_idx is None or self.layer_idx >= self.dense_layers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        slots = store_quest_kv(self, q, k, v, kv_cache, meta)
        plan = self._plan(meta, slots, q.dtype)
        out = q.new_empty(q.shape[0], self.num_heads, self.head_size_v)
        if plan.decode_slices:
            longest = max(meta.seq_lens_list[:meta.num_decodes])
            if self.is_sparse_layer and longest > self.token_budget:
                if not self._kernel_sparse_decode(q, kv_cache, meta, out):
                    self._sparse_decode(q, kv_cache, meta, out)
            else:
                self._decode(q, slots, plan.decode_slices, out)
        if plan.prefill_chunks:
            self._prefill(q, k, v, slots, plan.prefill_chunks, out)
        return out

    def _kernel_sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
                              meta: AttentionMetadata, out: torch.Tensor) -> bool:
        """The same selection and attention in one compiled call (fp32 CPU, csrc/quest.cpp);
        False when it does not apply (the PyTorch path below runs)."""
        n = meta.num_decodes
        ops = kernel_ops.cpu_kernels()
        if (ops is None or q.dtype != torch.float32 or kv_cache.dtype != torch.float32
                or not q.is_cpu or not kv_cache.is_contiguous() or q.stride(2) != 1):
            return False
        k_sel = max(1, self.token_budget // meta.block_size)
        out[:n] = ops.quest_decode(q[:n], kv_cache, meta.block_tables[:n].contiguous(),
                                   meta.seq_lens[:n], k_sel, self.scale, self.num_kv_heads)
        return True

    def _sparse_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       out: torch.Tensor) -> None:
        n, size = meta.num_decodes, meta.block_size
        kvh, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        seq_lens = meta.seq_lens[:n]
        num_blocks = (seq_lens + size - 1) // size
        max_blocks = -(-max(meta.seq_lens_list[:n]) // size)
        k_sel = min(max(1, self.token_budget // size), max_blocks)
        table = meta.block_tables[:n, :max_blocks]                           # [n, M]
        queries = q[:n].view(n, kvh, group, self.head_size)
        # one layer's cache as rows of D floats (see the layout above):
        #   row of (block b, KV head h, slot o) = b * KVH * (B + 1) + h * B + o
        #   row of block b's bound for head h   = b * KVH * (B + 1) + KVH * B + h
        rows_of = kv_cache.view(2, -1, self.head_size)                      # [2, rows, D]
        rows_per_block = kvh * (size + 1)
        heads = torch.arange(kvh, device=q.device)
        bound_rows = (table[..., None] * rows_per_block + kvh * size + heads).reshape(-1)
        key_min = rows_of[0].index_select(0, bound_rows).view(n, max_blocks, kvh, -1)
        key_max = rows_of[1].index_select(0, bound_rows).view(n, max_blocks, kvh, -1)
        chosen = select_blocks(block_bounds(queries, key_min, key_max), num_blocks, k_sel)
        #   chosen [n, KVH, k] logical -> physical block -> rows [n, KVH, k, B] -> [n, KVH, k*B, D]
        block_ids = table.gather(1, chosen.reshape(n, -1)).view(n, kvh, k_sel)
        offsets = torch.arange(size, device=q.device)
        rows = ((block_ids * rows_per_block + heads[None, :, None] * size)[..., None]
                + offsets).reshape(-1)
        keys = rows_of[0].index_select(0, rows).view(n, kvh, k_sel * size, -1)
        values = rows_of[1].index_select(0, rows).view(n, kvh, k_sel * size, -1)
        # logical position of each gathered slot; past the sequence's end (its partial last
        # block, or padding columns of a short sequence) is masked
        pos = (chosen[..., None] * size + offsets).view(n, kvh, -1)
        mask = torch.zeros(pos.shape, dtype=q.dtype, device=q.device).masked_fill_(
            pos >= seq_lens[:, None, None], float("-inf"))[:, :, None, :]
        attn = F.scaled_dot_product_attention(queries, keys.to(q.dtype), values.to(q.dtype),
                                              attn_mask=mask, scale=self.scale)
        out[:n] = attn.reshape(n, self.num_heads, self.head_size_v)


@register_backend("windowed_quest")
class WindowedQuestBackend(WindowedAttentionBackend):
    """A sliding window over QUEST's head-major cache (Gemma 3's local layers when QUEST is on:
    every layer of a model shares one cache layout, and the global layers' is QUEST's).

    The window's keys are few (Gemma 3: 512), so nothing is selected: the step writes K/V and
    bounds as QUEST does and attends over the window as ``windowed`` does: decodes through the
    compiled kernel over ``kv_slots`` (strided), prefill through a gather reading each key's
    KV-head rows in the head-major layout (the block diagram above)::

        slot s = block b * B + offset o  ->  row of KV head h = b * KVH * (B + 1) + h * B + o
    """

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return quest_cache_shape(self, num_blocks, block_size)

    def _store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> None:
        store_quest_kv(self, q, k, v, kv_cache, meta)

    def _window_decodes(self, q, kv_cache, meta, window, out) -> bool:
        # the compiled kernel over the slots in the paged order (strided: kv_slots)
        return super()._window_decodes(q, kv_slots(kv_cache, self.num_kv_heads), meta, window,
                                       out)

    def _gather_kv(self, kv_cache: torch.Tensor,
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kvh = self.num_kv_heads
        size = kv_cache.shape[2] // kvh - 1
        heads = torch.arange(kvh, device=slots.device) * size
        rows = ((slots // size * (kvh * (size + 1)) + slots % size)[:, None] + heads).reshape(-1)
        planes = kv_cache.view(2, -1, self.head_size)                 # rows of D values
        keys = planes[0].index_select(0, rows).view(-1, kvh, self.head_size)
        values = planes[1].index_select(0, rows).view(-1, kvh, self.head_size_v)
        return keys, values


def configure_quest(model: torch.nn.Module, token_budget: int, dense_layers: int) -> int:
    """Give every QUEST backend of ``model`` its budget and its layer index: its place among
    all the model's attention backends in module order (= layer order), so the first
    ``dense_layers`` layers of the model stay dense even where some layers are not QUEST's
    (Gemma 3's windowed ones). Returns how many QUEST backends it found."""
    if token_budget <= 0:
        raise ValueError(f"sparse_token_budget must be > 0, got {token_budget}")
    if dense_layers < 0:
        raise ValueError(f"quest_dense_layers must be >= 0, got {dense_layers}")
    backends = [b for m in model.modules() for b in vars(m).values()
                if isinstance(b, AttentionBackend)]
    found = 0
    for idx, backend in enumerate(backends):
        if isinstance(backend, QuestAttentionBackend):
            backend.layer_idx, backend.token_budget = idx, token_budget
            backend.dense_layers = dense_layers
            found += 1
    from kvforge.kernels.decode_stack import sync_stack_attention
    sync_stack_attention(model)          # a built compiled stack takes the new budget too
    return found
