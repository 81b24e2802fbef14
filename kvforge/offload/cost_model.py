"""FlexGen's cost model on two tiers (RAM, disk): the time of one decode step of a block of
``block_batches`` batches of ``batch_size`` sequences, and the fast-tier bytes a placement
needs.

Each decoder layer is in one of four placements: weights resident or streamed, KV in RAM or
on disk. Per layer the step takes ``max(io, compute)`` when the loader and the store thread
overlap I/O with compute (FlexGen's ``max(ctog, gtoc, dtoc, ctod, comp)``), ``io + compute``
when they do not; ``io`` is what the layer reads (streamed weights, the block's KV on disk)
and writes (each sequence's current KV block) on the one disk."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.offload.calibrate import HardwareCosts

# (weights resident, KV in RAM) of the four layer placements, in the order layers take them
CATEGORIES = ((True, True), (False, True), (True, False), (False, False))
KV_STAGING_SLOTS = 3           # one batch computing, one loading, one being written back


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model needs of a model: sizes of what streams and of what grows."""
    num_layers: int
    layer_bytes: int            # one decoder layer's weights in their storage format
    layer_params: int
    head_bytes: int             # the LM head (vocab x hidden), streamed in chunks
    head_params: int
    stage_bytes: int            # the largest unit the weight loader reads
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    kv_bytes_per_token_layer: int
    fixed_bytes: int            # always resident: norms, the rotary table
    # seconds of one decoder layer on one batch of decodes, timed on this model at start-up
    # (None: estimated from the calibrated linear rate, which misses attention and small ops)
    layer_batch_s: float | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def weight_bytes(self) -> int:
        return self.num_layers * self.layer_bytes + self.head_bytes


@dataclass(frozen=True)
class Workload:
    seq_len: int                 # tokens per sequence the KV must hold (prompt + output)
    step_tokens: int             # the engine's token budget per step (prefill chunks)
    block_size: int = 16         # tokens per KV block


def activation_bytes(m: ModelFacts, w: Workload, batch_size: int, block_batches: int) -> int:
    """Fast-tier bytes of activations: every batch's hidden + residual for the step's tokens,
    one batch's MLP intermediates (batches run one at a time) and the block's logits (twice:
    the sampler's working copy)."""
    seqs = batch_size * block_batches
    step_tokens = min(w.step_tokens, seqs * w.seq_len)
    batch_tokens = min(step_tokens, batch_size * w.seq_len)
    return 4 * (step_tokens * 2 * m.hidden_size
                + batch_tokens * (3 * m.intermediate_size + 4 * m.hidden_size)
                + 2 * seqs * m.vocab_size)


def kv_layer_bytes(m: ModelFacts, w: Workload, seqs: int) -> int:
    """One layer's KV of ``seqs`` sequences of ``seq_len`` tokens, in whole blocks."""
    blocks = seqs * math.ceil(w.seq_len / w.block_size)
    return blocks * w.block_size * m.kv_bytes_per_token_layer


def kv_bytes(m: ModelFacts, w: Workload, seqs: int) -> int:
    return kv_layer_bytes(m, w, seqs) * m.num_layers


def kv_staging_slot_bytes(m: ModelFacts, w: Workload, batch_size: int) -> int:
    """One batch's KV of one layer as staged from disk (plus a block per sequence of slack for
    the gaps a coalesced read goes through)."""
    return kv_layer_bytes(m, w, batch_size) + batch_size * w.block_size * m.kv_bytes_per_token_layer


def fast_tier_bytes(m: ModelFacts, w: Workload, batch_size: int, block_batches: int,
                    resident_layers: int, kv_ram_layers: int, slots: int) -> int:
    seqs = batch_size * block_batches
    staging = (KV_STAGING_SLOTS * kv_staging_slot_bytes(m, w, batch_size)
               if kv_ram_layers < m.num_layers else 0)
    return (resident_layers * m.layer_bytes + slots * m.stage_bytes
            + kv_ram_layers * kv_layer_bytes(m, w, seqs) + staging
            + activation_bytes(m, w, batch_size, block_batches) + m.fixed_bytes)


def layer_compute_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                    block_batches: int) -> float:
    """One layer over every batch of the block, one decode token per sequence: the weights'
    GEMM at ``batch_size`` rows per batch plus attention reading each sequence's KV."""
    if m.layer_batch_s is not None:
        return block_batches * m.layer_batch_s
    per_batch = (hw.linear_seconds(m.layer_params, batch_size) + hw.per_layer_call_s
                 + batch_size * w.seq_len * m.kv_bytes_per_token_layer / hw.memory_bytes_per_s)
    return block_batches * per_batch


def layer_load_s(m: ModelFacts, hw: HardwareCosts) -> float:
    return m.layer_bytes / hw.disk_read_bytes_per_s


def layer_kv_io_s(m: ModelFacts, hw: HardwareCosts, w: Workload, seqs: int) -> float:
    """A disk-KV layer's step: read the block's KV, write each sequence's current block."""
    write = seqs * w.block_size * m.kv_bytes_per_token_layer
    return (kv_layer_bytes(m, w, seqs) / hw.disk_read_bytes_per_s
            + write / hw.disk_write_bytes_per_s)


def head_s(m: ModelFacts, hw: HardwareCosts, seqs: int, overlap: bool) -> float:
    load = m.head_bytes / hw.disk_read_bytes_per_s
    compute = hw.linear_seconds(m.head_params, seqs)
    return max(load, compute) if overlap else load + compute


def category_layer_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                     block_batches: int, overlap: bool) -> list[float]:
    """Seconds of one layer in each placement of CATEGORIES."""
    compute = layer_compute_s(m, hw, w, batch_size, block_batches)
    load = layer_load_s(m, hw)
    kv_io = layer_kv_io_s(m, hw, w, batch_size * block_batches)
    out = []
    for resident, kv_ram in CATEGORIES:
        io = (0.0 if resident else load) + (0.0 if kv_ram else kv_io)
        out.append(max(io, compute) if overlap else io + compute)
    return out


def decode_step_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                  block_batches: int, counts: tuple[int, int, int, int], overlap: bool) -> float:
    """Seconds of one decode step of the block (every sequence gains one token) with
    ``counts`` layers in each placement of CATEGORIES."""
    per = category_layer_s(m, hw, w, batch_size, block_batches, overlap)
    return (sum(n * t for n, t in zip(counts, per))
            + head_s(m, hw, batch_size * block_batches, overlap))
