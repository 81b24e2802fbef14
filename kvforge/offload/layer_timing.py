"""Start-up timing of one real decoder layer on blocks of decodes, run as the offloaded forward
runs it (projections over the block's rows, attention per batch): the compute term of the cost
model for this model, batch size and sequence length (the calibrated linear rate alone misses
attention, norms, rotary and the per-call overheads, ~3x on a 135M model)."""
from __future__ import annotations

import math
import time

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.models.layerwise import layerwise_family
from kvforge.offload.cost_model import DENSE_GROUP_ROWS
from kvforge.offload.direct_io import AlignedBuffer
from kvforge.offload.weight_store import WeightStore, release_layer

BLOCK_POINTS = (1, 2, 4, 8, 16, 32)     # batches per block timed (the cost model interpolates)


def block_points(batch_size: int, max_batches: int) -> list[int]:
    """The block sizes worth timing: up to ``max_batches`` and one projection group (bigger
    blocks run as several groups of the same size, which the cost model extrapolates)."""
    fits = max(1, DENSE_GROUP_ROWS // batch_size)
    pts = [n for n in BLOCK_POINTS if n <= min(max_batches, fits)]
    top = min(max_batches, fits)
    return pts if top in pts else pts + [top]


@torch.inference_mode()
def time_layer_blocks(skeleton, store: WeightStore, batch_size: int, seq_len: int,
                      block_size: int, max_batches: int, reps: int = 3
                      ) -> tuple[tuple[int, float], ...]:
    """((batches, median seconds), ...) of layer 0 on blocks of ``batches`` x ``batch_size``
    decodes at context ``seq_len // 2``."""
    layer = skeleton.model.layers[0]
    buf = AlignedBuffer(store.layers[0]["nbytes"])
    store.read_layer(0, buf.view)
    store.bind_layer(layer, 0, buf.tensor)
    family = layerwise_family(type(skeleton))
    rotary = family.rotary(skeleton.model, 0)
    backend = layer.self_attn.attn
    context = max(1, seq_len // 2)
    per_seq = math.ceil((context + 1) / block_size)
    out = []
    for n in block_points(batch_size, max_batches):
        seqs = n * batch_size
        cache = torch.zeros(skeleton.kv_cache_shape(seqs * per_seq, block_size),
                            dtype=skeleton.kv_cache_dtype())
        metas = [AttentionMetadata.build(
            [1] * batch_size, [context] * batch_size,
            [list(range(i * per_seq, (i + 1) * per_seq))
             for i in range(b * batch_size, (b + 1) * batch_size)], block_size)
            for b in range(n)]

        def attend(q, k, v):
            y = torch.empty_like(q)
            for b, meta in enumerate(metas):
                rows = slice(b * batch_size, (b + 1) * batch_size)
                y[rows] = backend.forward(q[rows], k[rows], v[rows], cache, meta)
            return y

        # inside the RoPE table (StreamingLLM plans past the context; the rotation's cost is
        # the same at any position)
        at = min(context, skeleton.config.max_position_embeddings - 1)
        cos, sin = rotary.cos_sin(torch.full((seqs,), at, dtype=torch.int64))
        hidden = torch.randn(seqs, skeleton.config.hidden_size, dtype=skeleton.dtype) * 0.1
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            family.layer_forward(layer, hidden, hidden, rotary, cos, sin, attend)
            times.append(time.perf_counter() - start)
        out.append((n, sorted(times[1:])[reps // 2]))
    release_layer(layer)                  # drop the temporary buffer (the step binds again)
    return tuple(out)
