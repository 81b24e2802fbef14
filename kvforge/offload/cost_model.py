"""FlexGen's cost model on two tiers (RAM, disk): the time of one decode step of a block of
``block_batches`` batches of ``batch_size`` sequences, and the fast-tier bytes a placement
needs.

Each decoder layer is in one of four placements: weights resident or streamed, KV in RAM or
on disk. Per layer the step takes ``max(io, compute)`` when the loader and the store thread
overlap I/O with compute (FlexGen's ``max(ctog, gtoc, dtoc, ctod, comp)``), stretched by what
the two cost each other where they run at once (``HardwareCosts.overlapped_seconds``, measured
by the calibration), and ``io + compute`` when they do not overlap; ``io`` is what the layer
reads (streamed weights, the block's KV on disk) and writes (each sequence's current KV block)
on the one disk."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.offload.calibrate import HardwareCosts

# (weights resident, KV in RAM) of the four layer placements, in the order layers take them
CATEGORIES = ((True, True), (False, True), (True, False), (False, False))
# KV staging buffers of one batch each: one computing, the rest loading ahead or waiting for
# their write-back; at least KV_STAGING_SLOTS_MIN, and a block and a half of batches (one
# layer's batches and half the next layer's) on bigger blocks. With 3 the KV loader stalled
# whenever a write-back queued behind the weight reads on the one disk; 8 gave the 135M
# benchmark 11% more tok/s than 3. At its 20-batch block on the 2-core EPYC, 8 left compute
# waiting ~0.48 s of each ~1.5 s decode step for staged KV; 24-32 took the wait to ~0.01 s
# and the step to 1.07-1.27 s in 5 of 6 runs (alternated rounds: 1.19 / 1.27 / 1.58 s against
# 1.54 / 1.64 / 1.42 s with 8): the loader must get past a layer's end, where the slots still
# hold the layer's last batches, to the next layer's first
KV_STAGING_SLOTS_MIN = 8
# rows the sampler takes per call in an offloaded engine: its working copies of the logits
# (penalties, probabilities) are then this many rows, not the block's
SAMPLE_ROWS_PER_CALL = 16
# a layer's dense projections take up to this many of the step's tokens in one call (a decode
# block whole; a prefill step in groups of batches, which bounds the activations it holds)
DENSE_GROUP_ROWS = 512


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
    # ((batches, seconds), ...): one decoder layer on a block of that many batches of decodes
    # (projections over the block's rows, attention per batch), timed on this model at start-up
    # (None: estimated from the calibrated linear rate, which misses attention and small ops)
    layer_block_s: tuple[tuple[int, float], ...] | None = None

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


def group_tokens(w: Workload, batch_size: int, block_batches: int) -> int:
    """The most tokens one call of a layer's projections takes: a group of batches of at most
    DENSE_GROUP_ROWS tokens, or one batch when it alone is larger."""
    step_tokens = min(w.step_tokens, batch_size * block_batches * w.seq_len)
    return min(step_tokens, max(DENSE_GROUP_ROWS, batch_size * w.seq_len))


def activation_bytes(m: ModelFacts, w: Workload, batch_size: int, block_batches: int) -> int:
    """Fast-tier bytes of activations: hidden + residual of the step's tokens, one group's
    transients (normed input, q/k/v, attention output, MLP intermediates: at most 3
    intermediate + 8 hidden floats a token), the block's logits and the sampler's working
    copies of one call's (SAMPLE_ROWS_PER_CALL rows, two copies)."""
    seqs = batch_size * block_batches
    step_tokens = min(w.step_tokens, seqs * w.seq_len)
    return 4 * (step_tokens * 2 * m.hidden_size
                + group_tokens(w, batch_size, block_batches)
                * (3 * m.intermediate_size + 8 * m.hidden_size)
                + (seqs + 2 * min(seqs, SAMPLE_ROWS_PER_CALL)) * m.vocab_size)


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


def kv_staging_slots(block_batches: int) -> int:
    """KV staging buffers of a block of ``block_batches`` batches (KV_STAGING_SLOTS_MIN says
    why a block and a half)."""
    return max(KV_STAGING_SLOTS_MIN, math.ceil(1.5 * block_batches))


def kv_staging_bytes(m: ModelFacts, w: Workload, batch_size: int, block_batches: int) -> int:
    return kv_staging_slots(block_batches) * kv_staging_slot_bytes(m, w, batch_size)


def fast_tier_bytes(m: ModelFacts, w: Workload, batch_size: int, block_batches: int,
                    resident_layers: int, kv_ram_layers: int, slots: int) -> int:
    seqs = batch_size * block_batches
    staging = (kv_staging_bytes(m, w, batch_size, block_batches)
               if kv_ram_layers < m.num_layers else 0)
    return (resident_layers * m.layer_bytes + slots * m.stage_bytes
            + kv_ram_layers * kv_layer_bytes(m, w, seqs) + staging
            + activation_bytes(m, w, batch_size, block_batches) + m.fixed_bytes)


def layer_compute_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                    block_batches: int) -> float:
    """One layer over every batch of the block, one decode token per sequence: the weights'
    GEMM over the block's rows (in groups of at most DENSE_GROUP_ROWS) plus attention per
    batch reading each sequence's KV."""
    if m.layer_block_s:
        return interpolate_block_s(m.layer_block_s, block_batches)
    rows = batch_size * block_batches
    groups = math.ceil(rows / max(DENSE_GROUP_ROWS, batch_size))
    return (groups * (hw.linear_seconds(m.layer_params, math.ceil(rows / groups))
                      + hw.per_layer_call_s)
            + rows * w.seq_len * m.kv_bytes_per_token_layer / hw.memory_bytes_per_s)


def interpolate_block_s(points: tuple[tuple[int, float], ...], block_batches: int) -> float:
    """Seconds at ``block_batches`` from timed (batches, seconds) points: linear between them,
    proportional to the batches past the last (more groups of the same size)."""
    pts = sorted(points)
    if block_batches >= pts[-1][0]:
        return pts[-1][1] * block_batches / pts[-1][0]
    if block_batches <= pts[0][0]:
        return pts[0][1] * block_batches / pts[0][0]
    for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
        if n0 <= block_batches <= n1:
            return s0 + (s1 - s0) * (block_batches - n0) / (n1 - n0)
    raise AssertionError("unreachable")


def layer_load_s(m: ModelFacts, hw: HardwareCosts) -> float:
    return m.layer_bytes / hw.disk_read_bytes_per_s


def layer_kv_io_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                  block_batches: int) -> float:
    """A disk-KV layer's step: read the block's KV (a batch's full blocks and its current
    ones: two vectored reads), and write each batch's current blocks (one per sequence, K and
    V) to their fresh slots in one vectored write: a write's latency plus those blocks' bytes
    (at the read rate: the synced-write rate is not what a direct write of a written file
    sees). kv_slots.py says why the written blocks move."""
    current = batch_size * w.block_size * m.kv_bytes_per_token_layer
    write = block_batches * (hw.disk_block_write_s + current / hw.disk_read_bytes_per_s)
    # a direct read's latency is a small write's, give or take (same virtual disk queue)
    read = (kv_layer_bytes(m, w, batch_size * block_batches) / hw.disk_read_bytes_per_s
            + 2 * block_batches * hw.disk_block_write_s)
    return read + write


def head_s(m: ModelFacts, hw: HardwareCosts, seqs: int, overlap: bool) -> float:
    load = m.head_bytes / hw.disk_read_bytes_per_s
    compute = hw.linear_seconds(m.head_params, seqs)
    return hw.overlapped_seconds(load, compute) if overlap else load + compute


def category_layer_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                     block_batches: int, overlap: bool) -> list[float]:
    """Seconds of one layer in each placement of CATEGORIES."""
    compute = layer_compute_s(m, hw, w, batch_size, block_batches)
    load = layer_load_s(m, hw)
    kv_io = layer_kv_io_s(m, hw, w, batch_size, block_batches)
    out = []
    for resident, kv_ram in CATEGORIES:
        io = (0.0 if resident else load) + (0.0 if kv_ram else kv_io)
        out.append(hw.overlapped_seconds(io, compute) if overlap else io + compute)
    return out


def decode_step_s(m: ModelFacts, hw: HardwareCosts, w: Workload, batch_size: int,
                  block_batches: int, counts: tuple[int, int, int, int], overlap: bool) -> float:
    """Seconds of one decode step of the block (every sequence gains one token) with
    ``counts`` layers in each placement of CATEGORIES."""
    per = category_layer_s(m, hw, w, batch_size, block_batches, overlap)
    return (sum(n * t for n, t in zip(counts, per))
            + head_s(m, hw, batch_size * block_batches, overlap))
