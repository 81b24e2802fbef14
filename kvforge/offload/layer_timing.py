"""Start-up timing of one real decoder layer on one batch of decodes: the compute term of the
cost model for this model, batch size and sequence length (the calibrated linear rate alone
misses attention, norms, rotary and the per-call overheads, ~3x on a 135M model)."""
from __future__ import annotations

import math
import time

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.offload.direct_io import AlignedBuffer
from kvforge.offload.weight_store import WeightStore


@torch.inference_mode()
def time_layer_batch(skeleton, store: WeightStore, batch_size: int, seq_len: int,
                     block_size: int, reps: int = 5) -> float:
    """Median seconds of layer 0 on ``batch_size`` decodes at context ``seq_len // 2``."""
    layer = skeleton.model.layers[0]
    buf = AlignedBuffer(store.layers[0]["nbytes"])
    store.read_layer(0, buf.view)
    store.bind_layer(layer, 0, buf.tensor)
    context = max(1, seq_len // 2)
    per_seq = math.ceil((context + 1) / block_size)
    cache = torch.zeros(skeleton.kv_cache_shape(batch_size * per_seq, block_size),
                        dtype=skeleton.kv_cache_dtype())
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size)]
    meta = AttentionMetadata.build([1] * batch_size, [context] * batch_size, tables, block_size)
    rotary = skeleton.model.rotary_emb
    cos, sin = rotary.cos_sin(torch.full((batch_size,), context, dtype=torch.int64))
    hidden = torch.randn(batch_size, skeleton.config.hidden_size, dtype=skeleton.dtype) * 0.1
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        layer(hidden, hidden, rotary, cos, sin, cache, meta)
        times.append(time.perf_counter() - start)
    for p in layer.parameters():          # drop the temporary buffer (the step binds again)
        p.data = torch.empty(0, dtype=p.dtype)
    return sorted(times[1:])[reps // 2]
