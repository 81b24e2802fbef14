"""Cost model of a decode step under tensor parallel (TP) and data parallel (DP) on CPU nodes.

A decode step of ``batch`` sequences at ``context`` cached tokens, on the busiest rank of a TP
group of ``tp`` ranks (``busiest_rank``: its share of the weights W_r, KV heads kv_r of kv and
query heads nh_r, as the plan splits whole GQA groups; W / tp etc. when they divide evenly):

    bytes    = w W_r + B x C x kv_bytes x kv_r / kv     w = bytes per weight (4: fp32)
    flops    = 2 W_r B + 4 L nh_r hd B C
    compute  = max(bytes / bw_rank, flops / (cores_rank x flops_core))
    bw_rank  = min(cores_rank x bw_core, bw_node / ranks_on_node)    ranks on a node share it
    comm     = (2 L + 1) x allreduce(B x H x 4)         o and down per layer, the embedding
             + allgather(B x ceil(V / tp) x 4)           the LM head's logits
             + 3 x broadcast(small) + broadcast(B x H x 4)   step inputs, rows to project
    step     = compute + comm + overhead                 overhead: the engine's Python per step

    allreduce(n) = 2 (tp - 1) a + 2 (tp - 1) / tp x n / b        ring
    allgather(n) = (tp - 1) a + (tp - 1) x n / b
    broadcast(n) = ceil(log2 tp) x (a + n / b)                   tree

a (latency) and b (bandwidth) are the link's: inside a node the loopback / shared-memory path,
between nodes the network, used when a TP group spans nodes (the slowest hop sets a ring's pace).
DP runs ``dp`` independent replicas, each ``batch / dp`` sequences on ``tp`` ranks;
tokens per second = batch / step. Ranks fill nodes evenly: ranks_on_node = ceil(dp tp / nodes),
cores_rank = cores_node / ranks_on_node.

What it says: decode is weight-streaming. On one node TP divides the bytes per rank but also the
bandwidth per rank, so it gains nothing and pays comm; DP makes every replica stream all the
weights for a smaller batch, so it loses unless compute-bound. Across nodes both add bandwidth:
TP cuts latency per token when comm per step (~2 L all-reduces) is below the compute saved, DP
adds throughput with no comm at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from benchmarks.model_cost import ModelShape


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    cores_per_node: int
    node_mem_bw: float            # B/s, every core of a node reading
    core_mem_bw: float            # B/s, one core reading
    core_flops: float             # fp32 FLOP/s of one core
    link_latency: float           # s per hop inside a node (collectives' a)
    link_bw: float                # B/s per hop inside a node (collectives' b)
    net_latency: float = 50e-6    # s per hop between nodes
    net_bw: float = 1.25e9        # B/s per hop between nodes (10 Gbit/s)
    step_overhead: float = 0.0    # s of engine Python per step (scheduling, sampling, outputs)
    # all-reduces inside a node through shared memory (a, b of their own); None: the link's
    reduce_latency: float | None = None
    reduce_bw: float | None = None

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value is None and name.startswith("reduce_"):
                continue
            if value < 0 or (name in ("nodes", "cores_per_node") and value < 1):
                raise ValueError(f"ClusterSpec.{name} must be positive, got {value!r}")

    def with_overhead(self, seconds: float) -> "ClusterSpec":
        return replace(self, step_overhead=max(0.0, seconds))


def allreduce_seconds(nbytes: float, ranks: int, latency: float, bw: float) -> float:
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bw


def allgather_seconds(nbytes_each: float, ranks: int, latency: float, bw: float) -> float:
    if ranks == 1:
        return 0.0
    return (ranks - 1) * (latency + nbytes_each / bw)


def broadcast_seconds(nbytes: float, ranks: int, latency: float, bw: float) -> float:
    if ranks == 1:
        return 0.0
    return math.ceil(math.log2(ranks)) * (latency + nbytes / bw)


@dataclass(frozen=True)
class StepCost:
    compute: float
    comm: float
    overhead: float
    batch: float                  # sequences per replica

    @property
    def seconds(self) -> float:
        return self.compute + self.comm + self.overhead


def busiest_rank(shape: ModelShape, tp: int) -> tuple[float, int, float]:
    """(matmul parameters, KV heads, query heads) of the TP rank holding the most, as
    kvforge/distributed/tp_plan.py splits them: whole GQA groups, the first ranks one more
    where the KV heads do not divide (SmolLM2's 3 on 2 ranks: 2 + 1, so that rank holds 2/3 of
    the attention weights and the others wait for it at every all-reduce); fewer KV heads than
    ranks: each rank one (replicated) KV head and heads / tp query heads."""
    h, hd, kv = shape.hidden_size, shape.head_dim, shape.num_kv_heads
    group = shape.num_heads // kv
    if kv >= tp:
        kv_rank = -(-kv // tp)
        q_rank = kv_rank * group
    else:
        kv_rank, q_rank = 1, shape.num_heads / tp
    attention = 2 * h * q_rank * hd + 2 * h * kv_rank * hd
    mlp = 3 * h * -(-shape.intermediate_size // tp)
    head = h * -(-shape.vocab_size // tp)
    return shape.num_layers * (attention + mlp) + head, kv_rank, q_rank


def decode_step(shape: ModelShape, batch: float, context: int, spec: ClusterSpec, tp: int = 1,
                dp: int = 1, weight_bytes: float = 4.0) -> StepCost:
    """One replica's decode step when ``dp`` replicas of ``tp`` ranks share the cluster and
    ``batch`` sequences; ``weight_bytes`` per matmul parameter (4 in fp32, ~0.6 in a GGUF
    file's 4-bit blocks)."""
    if tp < 1 or dp < 1 or batch <= 0:
        raise ValueError(f"tp, dp must be >= 1 and batch > 0, got {tp}, {dp}, {batch}")
    ranks_on_node = math.ceil(dp * tp / spec.nodes)
    if ranks_on_node > spec.cores_per_node:
        raise ValueError(f"{dp * tp} ranks do not fit {spec.nodes} nodes of "
                         f"{spec.cores_per_node} cores")
    cores = spec.cores_per_node / ranks_on_node
    b = batch / dp
    bw = min(cores * spec.core_mem_bw, spec.node_mem_bw / ranks_on_node)
    params, kv_heads, q_heads = busiest_rank(shape, tp)
    nbytes = (weight_bytes * params
              + b * context * shape.kv_bytes_per_cached_token * kv_heads / shape.num_kv_heads)
    flops = (2.0 * params * b + 4.0 * shape.num_layers * q_heads * shape.head_dim * b * context)
    compute = max(nbytes / bw, flops / (cores * spec.core_flops))
    spans_nodes = tp > ranks_on_node
    a, link = ((spec.net_latency, spec.net_bw) if spans_nodes
               else (spec.link_latency, spec.link_bw))
    hidden = b * shape.hidden_size * 4
    ra, rlink = a, link
    if not spans_nodes and spec.reduce_latency is not None:
        ra, rlink = spec.reduce_latency, spec.reduce_bw
    comm = ((2 * shape.num_layers + 1) * allreduce_seconds(hidden, tp, ra, rlink)
            + allgather_seconds(b * math.ceil(shape.vocab_size / tp) * 4, tp, a, link)
            + 3 * broadcast_seconds(256, tp, a, link) + broadcast_seconds(hidden, tp, a, link))
    return StepCost(compute=compute, comm=comm, overhead=spec.step_overhead, batch=b)


def decode_tokens_per_second(shape: ModelShape, batch: int, context: int, spec: ClusterSpec,
                             tp: int = 1, dp: int = 1, weight_bytes: float = 4.0) -> float:
    step = decode_step(shape, batch, context, spec, tp, dp, weight_bytes)
    return dp * step.batch / step.seconds


def fit_allreduce(sizes: list[int], seconds: list[float], ranks: int) -> tuple[float, float]:
    """(latency a, bandwidth b) of the ring formula fitted to measured all-reduce times by
    least squares (b = inf when the times do not grow with size)."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError("need as many times as sizes, at least one")
    xs = [2 * (ranks - 1) / ranks * n for n in sizes]     # seconds = 2 (r-1) a + x / b
    k = 2 * (ranks - 1)
    if len(sizes) == 1:
        return seconds[0] / k, math.inf
    mx, my = sum(xs) / len(xs), sum(seconds) / len(seconds)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    return max(intercept, 0.0) / k, (1.0 / slope if slope > 0 else math.inf)
