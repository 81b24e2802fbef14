"""The TP / DP cost model: limits that follow from its formulas."""
from __future__ import annotations

import math

import pytest

from benchmarks.distributed_cost import (ClusterSpec, allreduce_seconds, busiest_rank,
                                         decode_step, decode_tokens_per_second, fit_allreduce)
from benchmarks.model_cost import ModelShape

SMOLLM2 = ModelShape(hidden_size=576, intermediate_size=1536, vocab_size=49152, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64)
BOX = ClusterSpec(nodes=1, cores_per_node=2, node_mem_bw=20e9, core_mem_bw=12e9,
                  core_flops=50e9, link_latency=20e-6, link_bw=5e9)


def test_fit_recovers_the_ring_parameters():
    sizes = [4, 1024, 65536, 1 << 20, 1 << 24]
    times = [allreduce_seconds(n, 4, 30e-6, 2e9) for n in sizes]
    a, b = fit_allreduce(sizes, times, 4)
    assert a == pytest.approx(30e-6) and b == pytest.approx(2e9)


def test_one_node_bandwidth_bound_tp_gains_nothing_and_pays_comm():
    one = decode_step(SMOLLM2, 1, 256, BOX)
    two = decode_step(SMOLLM2, 1, 256, BOX, tp=2)
    assert one.comm == 0 and two.comm > 0
    # node bandwidth shared by both ranks: half the bytes at half the bandwidth, or more than
    # half on the rank holding 2 of SmolLM2's 3 KV heads
    assert one.compute < two.compute < 1.2 * one.compute
    assert decode_tokens_per_second(SMOLLM2, 1, 256, BOX, tp=2) < \
        decode_tokens_per_second(SMOLLM2, 1, 256, BOX)


def test_dp_on_one_node_streams_the_weights_twice():
    tp1 = decode_tokens_per_second(SMOLLM2, 8, 256, BOX)
    dp2 = decode_tokens_per_second(SMOLLM2, 8, 256, BOX, dp=2)
    assert dp2 < tp1


def test_across_nodes_dp_adds_throughput_and_a_fast_network_lets_tp_cut_latency():
    two_nodes = ClusterSpec(**{**vars(BOX), "nodes": 2})
    one = decode_tokens_per_second(SMOLLM2, 8, 256, BOX)
    # each replica on its own node with the batch one node served: twice the tokens
    assert decode_tokens_per_second(SMOLLM2, 16, 256, two_nodes, dp=2) == pytest.approx(
        2 * one, rel=0.01)
    fast = ClusterSpec(**{**vars(two_nodes), "net_latency": 2e-6, "net_bw": 12.5e9})
    slow = ClusterSpec(**{**vars(two_nodes), "net_latency": 200e-6, "net_bw": 0.125e9})
    # tp=2 on 2 nodes: one rank per node, the ring crosses the network
    assert decode_step(SMOLLM2, 1, 256, fast, tp=2).seconds < decode_step(SMOLLM2, 1, 256, BOX).seconds
    assert decode_step(SMOLLM2, 1, 256, slow, tp=2).seconds > decode_step(SMOLLM2, 1, 256, BOX).seconds


def test_too_many_ranks_for_the_cores_is_an_error():
    with pytest.raises(ValueError, match="4 ranks do not fit 1 nodes of 2 cores"):
        decode_step(SMOLLM2, 1, 1, BOX, tp=2, dp=2)
    assert math.isfinite(decode_step(SMOLLM2, 1, 1, BOX, tp=2).seconds)


def test_the_busiest_rank_sets_the_pace():
    """SmolLM2's 3 KV heads on 2 ranks: one rank holds 2 of them (6 of 9 query heads), so its
    share of the weights is above half; an even split (2 KV heads of a 1.5B-like shape) is
    exactly half; one rank holds everything."""
    params, kv, q = busiest_rank(SMOLLM2, 2)
    assert (kv, q) == (2, 6) and params > SMOLLM2.matmul_params / 2
    assert busiest_rank(SMOLLM2, 1) == (SMOLLM2.matmul_params, 3, 9)
    even = ModelShape(hidden_size=1536, intermediate_size=8960, vocab_size=151936, num_layers=28,
                      num_heads=12, num_kv_heads=2, head_dim=128)
    assert busiest_rank(even, 2) == (even.matmul_params / 2, 1, 6)
    # fewer KV heads than ranks: each rank holds one whole (replicated) KV head
    mqa = ModelShape(hidden_size=256, intermediate_size=512, vocab_size=1000, num_layers=2,
                     num_heads=4, num_kv_heads=1, head_dim=64)
    assert busiest_rank(mqa, 2)[1:] == (1, 2.0)
