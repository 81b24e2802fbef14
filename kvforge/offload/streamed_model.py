"""A model (a family of ``models/layerwise.py``: Llama's or Gemma 3's) whose decoder layers,
LM head and (where placed there) KV stream from the disk tier.

``forward`` keeps the model contract the ModelRunner calls (token ids, positions, the paged KV
caches, the step's AttentionMetadata), so the scheduler, the paged KV, continuous batching and
the server run unchanged on top. Inside, the step's sequences are cut into batches of
``batch_size`` (together: the block) and traversed in the zig-zag order: a layer's weights,
read once (or resident), serve every batch of the block while the weight loader reads the next
layer; a disk-KV layer's batches are staged by the KV loader one batch ahead and written back
by the store thread behind. The batches' activations are all in RAM, so a layer's dense
projections (q/k/v, o, MLP) run over a whole group of batches (up to ``DENSE_GROUP_ROWS``
tokens: the whole block of a decode step) in one call, where a GEMM costs a third per row of
what it costs on one batch; only a disk-KV layer's attention runs batch by batch, on the KV
staged for that batch (a RAM-KV layer attends over the group at once). The LM head streams in
chunks of at most a layer's size, each chunk serving every row of the block."""
from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.attention.metadata import AttentionMetadata
from kvforge.kernels import ops as kernel_ops
from kvforge.models.base import PagedKVModelMixin
from kvforge.models.layerwise import layerwise_family
from kvforge.offload.cost_model import DENSE_GROUP_ROWS, kv_staging_slots
from kvforge.offload.direct_io import AlignedBuffer
from kvforge.offload.kv_disk import BlockReadPlan, DiskKVLayer, plan_block_reads
from kvforge.offload.kv_slots import DiskSlotMap
from kvforge.offload.loader import Stage, StageLoader
from kvforge.offload.policy import Placement
from kvforge.offload.schedule import group_batches, split_batches, walks_forward, zigzag_order
from kvforge.offload.store_worker import StoreWorker
from kvforge.offload.trace import TraceRecorder
from kvforge.offload.weight_store import WeightStore, release_layer
from kvforge.quant.gguf import blocks_multiply


# threads reading KV stages: a batch's stage is a few 100 KB of vectored direct reads that wait
# behind the weight loader's layer reads on the one disk; two keep a second read queued (the
# 135M benchmark: 6-19% more tok/s in 8 of 10 alternated pairs). They share the
# KV staging buffers the cost model counts, so the fast tier's bytes do not change.
KV_LOADER_THREADS = 2


@dataclass
class _Batch:
    tokens: tuple[int, int]               # [t0, t1) of the step's tokens
    plan: BlockReadPlan | None = None     # disk-KV layers: staged blocks
    local_meta: AttentionMetadata | None = None
    # blocks with new tokens: (first fresh slot, local ids) runs, one vectored write each
    write_runs: list[tuple[int, list[int]]] | None = None


@dataclass
class _Group:
    """Consecutive batches whose rows the dense projections take in one call."""
    tokens: tuple[int, int]               # [t0, t1) of the step's tokens
    batches: list[int]                    # indices into the step's batches
    meta: AttentionMetadata | None        # global block ids (RAM-KV layers' attention)


def _glibc():
    """glibc, or None off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3       # mallopt parameters (malloc.h)


def bound_heap() -> None:
    """Keep freed activations from holding the process's RSS above the budget the policy
    planned. glibc raises its mmap threshold to the size of every large block freed, so after
    the first layer a step's activations (MiBs, a different size per group of batches) come
    from the heap, and the heap fragments: the 135M benchmark's 2,048-token prefill steps grew
    it by ~130 MiB over their 87 MiB of planned activations (peak +200-220 MiB over the started
    engine). A fixed 1 MiB threshold maps each larger tensor on its own and unmaps it when
    freed (the heap's top is trimmed past 1 MiB): peak +73-80 MiB, prefill ~6% slower from the
    page faults (256 KiB: +67 MiB, 35% slower; 4 MiB: no bound). It must be set before the
    engine's start-up allocations (the runner does, first thing): set after them, the heap
    still grew as before. Process-wide: an offloaded engine process is one that runs under a
    memory budget. A step still ends with ``malloc_trim`` (small blocks' arenas)."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
        _LIBC.mallopt(_M_TRIM_THRESHOLD, 1 << 20)


class OffloadedLM(PagedKVModelMixin, nn.Module):
    def __init__(self, skeleton: nn.Module, store: WeightStore, placement: Placement,
                 trace: TraceRecorder | None = None) -> None:
        super().__init__()
        self.inner = skeleton
        self.family = layerwise_family(type(skeleton))
        self.config = skeleton.config
        self.num_layers = skeleton.num_layers
        self.dtype = skeleton.dtype
        self.store = store
        self.placement = placement
        self.trace = trace or TraceRecorder()
        model = skeleton.model
        # the skeleton's tables (never touched, or a GGUF file's map): the store serves them
        model.embed_tokens = None
        release_layer(skeleton.lm_head)
        model.norm.weight.data = store.read_norm()
        self._resident_buffers = []
        self.resident_layers = set(placement.resident_layers)
        for j in sorted(self.resident_layers):
            buf = AlignedBuffer(store.layers[j]["nbytes"])
            store.read_layer(j, buf.view)
            store.bind_layer(model.layers[j], j, buf.tensor)
            self._resident_buffers.append(buf)
        self.head_chunks = store.head_chunks(store.layer_bytes)
        self.loader = StageLoader(store.stage_bytes, placement.slots, placement.overlap,
                                  self.trace)
        self.kv_disk: dict[int, DiskKVLayer] = {}
        self.kv_slots: DiskSlotMap | None = None
        self.kv_loader: StageLoader | None = None
        self.store_worker: StoreWorker | None = None
        self._head_scheduled = False
        self._step_start: float | None = None
        self._step_seqs = 0
        # (sequences, seconds) of each all-decode step: the measured decode throughput
        self.decode_steps: list[tuple[int, float]] = []

    def attach_kv_disk(self, layers: dict[int, DiskKVLayer], slots: DiskSlotMap | None) -> None:
        """Disk-KV layers (the runner creates their files once the pool size is known) and the
        slot map they share."""
        self.kv_disk = layers
        self.kv_slots = slots
        if layers:
            self.kv_loader = StageLoader(1 << 20, kv_staging_slots(self.placement.block_batches),
                                         True, self.trace, threads=KV_LOADER_THREADS)
            self.store_worker = StoreWorker(self.trace)

    def first_attention_backend(self):
        return self.inner.model.layers[0].self_attn.attn

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read + sum(d.bytes_read for d in self.kv_disk.values())

    @property
    def bytes_written(self) -> int:
        return sum(d.bytes_written for d in self.kv_disk.values())

    def close(self) -> None:
        self.loader.close()
        if self.kv_loader is not None:
            self.kv_loader.close()
            self.store_worker.close()
        for d in self.kv_disk.values():
            d.close()
        self.store.close()

    # ------------------------------------------------------------ stages
    def _layer_stage(self, j: int) -> Stage:
        store = self.store
        return Stage(f"layer {j}", lambda buf: store.read_layer(j, buf))

    def _head_stages(self) -> list[Stage]:
        store = self.store
        return [Stage(f"head {i}", lambda buf, c=c: store.read_head_chunk(c, buf))
                for i, c in enumerate(self.head_chunks)]

    def _batches(self, meta: AttentionMetadata) -> tuple[list[_Batch], list[_Group]]:
        ranges = split_batches(meta.num_seqs, self.placement.batch_size)
        qsl = meta.query_start_loc.tolist()
        B = meta.block_size
        ctx_all = meta.context_lens.tolist()
        tables_all = [meta.block_tables[i, :math.ceil(meta.seq_lens_list[i] / B)].tolist()
                      for i in range(meta.num_seqs)]
        batches = []
        for a, b in ranges:
            batch = _Batch((qsl[a], qsl[b]))
            if self.kv_disk:
                q = meta.query_lens_list[a:b]
                ctx = ctx_all[a:b]
                tables = tables_all[a:b]
                slot_of = self.kv_slots.slot_of
                # a window's freed entries (NULL_BLOCK, -1) are neither staged nor read
                plan = plan_block_reads([slot_of[x] for t in tables for x in t if x >= 0])
                local = [[plan.local_of[slot_of[x]] if x >= 0 else x for x in t] for t in tables]
                batch.plan = plan
                batch.local_meta = AttentionMetadata.build(q, ctx, local, B)
                # the blocks taking this step's tokens move to fresh slots, one run per batch:
                # blocks this step fills first, then those that take tokens next step too, so
                # the next step's move leaves no holes between the batch's full blocks
                written = list(dict.fromkeys(
                    t[p // B] for t, c, n in zip(tables, ctx, q) for p in range(c, c + n)))
                open_ = {t[(c + n - 1) // B] for t, c, n in zip(tables, ctx, q) if (c + n) % B}
                written.sort(key=lambda x: x in open_)
                batch.write_runs = [(first, [plan.local_of[slot_of[x]] for x in blocks])
                                    for first, blocks in self.kv_slots.reserve(written)]
            batches.append(batch)
        groups = []
        ram_kv = len(self.kv_disk) < self.num_layers
        for ks in group_batches([b.tokens[1] - b.tokens[0] for b in batches], DENSE_GROUP_ROWS):
            a, b = ranges[ks[0]][0], ranges[ks[-1]][1]
            sub = None
            if ram_kv:
                sub = meta if len(ks) == len(batches) else AttentionMetadata.build(
                    meta.query_lens_list[a:b], ctx_all[a:b], tables_all[a:b], B)
            groups.append(_Group((qsl[a], qsl[b]), ks, sub))
        return batches, groups

    # ------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv caches for {self.num_layers} layers")
        self.loader.drain()          # head chunks of a step that needed no logits
        if self.kv_slots is None:
            return self._forward(input_ids, positions, kv_caches, meta)
        try:
            hidden = self._forward(input_ids, positions, kv_caches, meta)
        except BaseException:
            self._abandon_step()
            raise
        self.kv_slots.commit()       # the step's blocks are on disk at their fresh slots
        return hidden

    def _abandon_step(self) -> None:
        """A failed step: let its submitted writes land (or fail) and give its fresh slots
        back, so the blocks keep their pre-step slots, which nothing wrote."""
        try:
            self.store_worker.flush()
        except Exception:           # the step's own error is the one to raise
            pass
        self.kv_slots.rollback()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        self._step_start = self.trace.now()
        self._step_seqs = meta.num_seqs if meta.num_decodes == meta.num_seqs else 0
        batches, groups = self._batches(meta)
        order = zigzag_order(self.num_layers, len(batches))
        streamed = [j for j in range(self.num_layers) if j not in self.resident_layers]
        self.loader.schedule([self._layer_stage(j) for j in streamed] + self._head_stages())
        self._head_scheduled = True
        if self.kv_disk:
            self._schedule_kv(batches, order)

        model, family = self.inner.model, self.family
        hidden = [family.embed(model, self.store.embedding_rows(input_ids[g.tokens[0]:
                                                                           g.tokens[1]]))
                  for g in groups]
        residual: list[torch.Tensor | None] = [None] * len(groups)
        # per RoPE the family's layers take (Gemma 3: local and global), per group
        cos_sin = {id(rotary): [rotary.cos_sin(positions[g.tokens[0]:g.tokens[1]])
                                for g in groups]
                   for rotary in family.rotaries(model)}
        for j in range(self.num_layers):
            layer = model.layers[j]
            rotary = family.rotary(model, j)
            if j not in self.resident_layers:
                weights = self.loader.acquire(f"layer {j}")
                self.store.bind_layer(layer, j, weights.tensor)
            start = self.trace.now()
            # the zig-zag: groups, and batches within them, in the order `order` staged the KV
            forward_dir = walks_forward(j)
            disk = self.kv_disk.get(j)
            for g in (range(len(groups)) if forward_dir else range(len(groups) - 1, -1, -1)):
                group = groups[g]
                cos, sin = cos_sin[id(rotary)][g]
                if disk is None:
                    attend = (lambda q, k, v, c=kv_caches[j], m=group.meta:
                              layer.self_attn.attn.forward(q, k, v, c, m))
                else:
                    attend = self._disk_attention(j, layer, disk, batches, group, forward_dir)
                hidden[g], residual[g] = family.layer_forward(layer, hidden[g], residual[g],
                                                              rotary, cos, sin, attend)
            self.trace.add("compute", f"layer {j}", start, self.trace.now())
            if j not in self.resident_layers:
                self.loader.release(weights)
        if self.store_worker is not None:
            self.store_worker.flush()             # the next step reads what this one wrote
        out = [family.final_norm(model, h, r) for h, r in zip(hidden, residual)]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _disk_attention(self, j: int, layer, disk: DiskKVLayer, batches: list[_Batch],
                        group: _Group, forward_dir: bool):
        """Attention of a disk-KV layer over ``group``'s rows: batch by batch, each on the KV
        the KV loader staged for it, its new blocks handed to the store thread."""
        backend = layer.self_attn.attn

        def attend(q, k, v):
            out = None
            t0 = group.tokens[0]
            for kb in (group.batches if forward_dir else reversed(group.batches)):
                batch = batches[kb]
                lo, hi = batch.tokens[0] - t0, batch.tokens[1] - t0
                slot = self.kv_loader.acquire(f"kv {j}/{kb}")
                cache = disk.staging_view(slot.tensor, batch.plan)
                y = backend.forward(q[lo:hi], k[lo:hi], v[lo:hi], cache, batch.local_meta)
                if out is None:
                    out = y.new_empty((q.shape[0],) + tuple(y.shape[1:]))
                out[lo:hi] = y
                self.store_worker.submit(
                    f"kv {j}/{kb}",
                    lambda b=batch, s=slot: disk.write(b.plan.num_local, b.write_runs,
                                                      s.buffer.view),
                    lambda s=slot: self.kv_loader.release(s))
            return out

        return attend

    def _schedule_kv(self, batches: list[_Batch], order: list[tuple[int, int]]) -> None:
        need = max(next(iter(self.kv_disk.values())).staging_bytes(b.plan) for b in batches)
        if need > self.kv_loader.slot_bytes:
            self.kv_loader.resize(need)
        self.kv_loader.schedule([
            Stage(f"kv {j}/{k}", lambda buf, d=self.kv_disk[j], p=batches[k].plan: d.read(p, buf))
            for j, k in order if j in self.kv_disk])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every row's logits, one streamed head chunk at a time (each chunk serves all rows)."""
        if not self._head_scheduled:
            self.loader.drain()
            self.loader.schedule(self._head_stages())
        self._head_scheduled = False
        logits = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=torch.float32)
        x = hidden.reshape(-1, hidden.shape[-1])
        for i, chunk in enumerate(self.head_chunks):
            slot = self.loader.acquire(f"head {i}")
            w = self.store.head_chunk_weight(chunk, slot.tensor)
            start = self.trace.now()
            if isinstance(w, torch.Tensor):
                y = kernel_ops.linear_rows(x, w)
                if y is None:
                    y = torch.nn.functional.linear(x, w)
            else:                                       # GGUF block rows
                y = blocks_multiply(w, x, None)
            logits[:, chunk.row_start:chunk.row_end] = y
            self.trace.add("compute", f"head {i}", start, self.trace.now())
            self.loader.release(slot)
        logits = self.family.logits(self.inner, logits)
        if self._step_seqs and self._step_start is not None:
            self.decode_steps.append((self._step_seqs, self.trace.now() - self._step_start))
            self._step_start = None
        if _LIBC is not None:
            _LIBC.malloc_trim(0)
        return logits
