"""Tensor and data parallel on this machine: collective latencies, TP=1/2 and DP=1/2 decode
throughput, and the cost model's prediction beside each (benchmarks/distributed_cost.py,
docs/distributed.md).

    python benchmarks/distributed.py                         # SmolLM2, a few minutes on 2 cores
    python benchmarks/distributed.py --quick                 # functional run: tiny sizes
    python benchmarks/distributed.py --nodes 4 --cores-per-node 32 --net-gbps 25

1. All-reduce by message size, ``--ranks`` processes: gloo over loopback and the shared-memory
   all-reduce (kvforge/distributed/shm_allreduce.py, spinning waits: what tensor parallel uses
   between local ranks, gloo across machines): median latency and bus bandwidth
   (2 (n-1)/n x bytes / time, the ring's per-link traffic), each fitted to the ring formula's
   latency a and bandwidth b; the per-step input broadcast (pickled object) too.
2. This machine's parameters: read bandwidth with every core and with one, one core's GEMM
   FLOP/s.
3. Decode throughput, ``--batch`` greedy requests of ``--prompt-len`` random tokens and
   ``--output-len`` outputs: TP=1 (compiled decode stack, multi-step decoding), TP=1 with the
   Python layers a TP slice runs, TP=2, and DP=2 (two engine processes, half the batch each,
   started together; no HTTP). Decode tok/s = decoded tokens / time from the last first token
   to the last finish. The cost model's engine overhead per step is calibrated on the TP=1 rows
   (so those match by construction); TP=2 and DP=2 are predictions.
4. What-if: the same model on ``--nodes`` x ``--cores-per-node`` with a ``--net-gbps`` network,
   with this machine's per-core numbers: predictions only.
Ends with one ``SUMMARY distributed:`` line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import multiprocessing as mp
import os
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.distributed_cost import ClusterSpec, decode_step, fit_allreduce
from benchmarks.hardware import ReadBandwidthSampler, hardware_line, measure_gemm_peak_flops, physical_cores
from benchmarks.model_cost import ModelShape
from benchmarks.report import format_table, write_json
from kvforge.distributed.shm_allreduce import ShmAllReduce

DEFAULT_SIZES = [4, 64, 1024, 16 << 10, 256 << 10, 4 << 20, 16 << 20]
QUICK_SIZES = [4, 1024, 64 << 10]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the all-reduce table")
    p.add_argument("--sizes", default=None, help="all-reduce sizes in bytes, comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quantization", default="auto",
                   help="the engines' --quantization: auto runs a GGUF file in its own blocks, "
                        "none dequantized to fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--nodes", type=int, default=2, help="what-if cluster: nodes")
    p.add_argument("--cores-per-node", type=int, default=16, help="what-if cluster: cores")
    p.add_argument("--net-gbps", type=float, default=10.0, help="what-if network, Gbit/s")
    p.add_argument("--net-latency-us", type=float, default=50.0, help="what-if network hop")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a functional run")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.batch, args.prompt_len, args.output_len = 3, 2, 8, 4
    sizes = args.sizes or ",".join(map(str, QUICK_SIZES if args.quick else DEFAULT_SIZES))
    args.size_list = [int(s) for s in sizes.split(",")]
    if args.ranks < 2 or args.batch < 2 or args.output_len < 2 or args.reps < 1:
        raise SystemExit("--ranks >= 2, --batch >= 2, --output-len >= 2, --reps >= 1")
    return args


def matmul_bytes_per_param(source, quantization: str) -> float:
    """Bytes a matmul weight takes as the engines run it: 4 in fp32, the file's own block
    bytes (decoder projections and head) when a GGUF file runs natively."""
    from kvforge.distributed.tp_model import tensor_parallel_quantization
    if tensor_parallel_quantization(quantization, source, torch.float32, "cpu") != "gguf":
        return 4.0
    tensors = [t for t in source._reader.tensors if len(t.shape) == 2
               and (t.name.startswith("blk.") or t.name in ("output.weight", "token_embd.weight"))]
    return sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


# ---------------------------------------------------------------- 1. collectives
def _median_seconds(fn, reps: int) -> float:
    fn()                                               # warm-up: connections, buffers
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective_rank(rank: int, ranks: int, port: int, sizes: list[int], reps: int,
                     results, shm_name: str, store=None, shm=None) -> None:
    """One rank of the all-reduce tables (gloo, shared memory); rank 0 (given the store it
    serves and the shared-memory file it made) puts the medians on ``results``."""
    from kvforge.distributed.comm import CommGroup, connect_store
    torch.set_num_threads(1)
    store = store or connect_store("127.0.0.1", port, ranks)
    comm = CommGroup(store, rank, ranks, bind_host="127.0.0.1")
    shm = shm or ShmAllReduce(shm_name, rank, ranks, max(sizes), create=False)
    table = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4))
        table[size] = (_median_seconds(lambda: comm.all_reduce(t), reps),
                       _median_seconds(lambda: shm.all_reduce(t), reps))
    # a step's inputs as the tensor-parallel driver sends them
    step_input = ("forward", torch.arange(8), torch.arange(8), {"block_tables": [[0, 1, 2]] * 8})
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        comm.broadcast_object(step_input if rank == 0 else None)
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put((table, statistics.median(times), len(pickle.dumps(step_input))))


def collective_table(ranks: int, sizes: list[int], reps: int
                     ) -> tuple[dict[int, tuple[float, float]], float, int]:
    """({bytes: median all-reduce seconds (gloo, shared memory)}, median step-input broadcast
    seconds, its bytes)."""
    from kvforge.distributed.comm import open_store
    ctx = mp.get_context("spawn")
    store = open_store("127.0.0.1", ranks)
    shm_name = f"kvforge-bench-allreduce-{os.getpid()}"
    shm = ShmAllReduce(shm_name, 0, ranks, max(sizes), create=True)
    results = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, daemon=True,
                         args=(r, ranks, store.port, sizes, reps, results, shm_name))
             for r in range(1, ranks)]
    for p in procs:
        p.start()
    try:
        _collective_rank(0, ranks, store.port, sizes, reps, results, shm_name, store=store,
                         shm=shm)
        return results.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
        shm.close()


# ---------------------------------------------------------------- 3. engines
def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _decode_rate(outputs) -> tuple[int, float]:
    """(tokens decoded after each request's first, seconds from the last first token to the
    last finish)."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = max(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return tokens, end - start


def run_engine(model, engine_kwargs: dict, prompts, output_len: int,
               python_layers: bool = False, all_reduce: str = "auto") -> tuple[int, float]:
    from kvforge import LLM, SamplingParams
    given = os.environ.get("KVFORGE_TP_ALLREDUCE")
    os.environ["KVFORGE_TP_ALLREDUCE"] = all_reduce
    try:
        llm = LLM(model, **engine_kwargs)
    finally:                              # the caller's own setting back
        if given is None:
            os.environ.pop("KVFORGE_TP_ALLREDUCE")
        else:
            os.environ["KVFORGE_TP_ALLREDUCE"] = given
    try:
        if python_layers:
            # what a TP slice runs: the Python layers, one step per engine step (the compiled
            # stack and multi-step decoding are the single-process fast path)
            llm.engine.runner.model._decode_stack = None
            llm.engine._max_decode_steps = 1
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
        return _decode_rate(llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.engine.shutdown()


def _replica(model, engine_kwargs, prompts, output_len, barrier, results) -> None:
    from kvforge import LLM, SamplingParams
    llm = LLM(model, **engine_kwargs)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    barrier.wait()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    results.put(_decode_rate(llm.generate(prompts, params, use_tqdm=False)))


def run_data_parallel(model, engine_kwargs: dict, prompts, output_len: int,
                      replicas: int) -> tuple[int, float]:
    """``replicas`` engine processes, the batch split between them, generating together."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(replicas), ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(model, engine_kwargs, prompts[i::replicas],
                                                output_len, barrier, results))
             for i in range(replicas)]
    for p in procs:
        p.start()
    measured = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
    return sum(t for t, _ in measured), max(s for _, s in measured)


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    from kvforge.loader.source import load_model_source
    cores = physical_cores()
    torch.set_num_threads(cores)
    print(hardware_line())
    source = load_model_source(args.model)
    shape = ModelShape.from_config(source.config)
    weight_bytes = matmul_bytes_per_param(source, args.quantization)
    step_cost = functools.partial(decode_step, weight_bytes=weight_bytes)

    table, bcast_s, bcast_bytes = collective_table(args.ranks, args.size_list, args.reps)
    bus = lambda size, t: 2 * (args.ranks - 1) / args.ranks * size / t / 1e9   # noqa: E731
    rows = [[f"{size:,}", gloo * 1e6, bus(size, gloo), shm * 1e6, bus(size, shm)]
            for size, (gloo, shm) in table.items()]
    print(f"\nall-reduce, {args.ranks} ranks: gloo over loopback vs shared memory "
          f"(kvforge/distributed/shm_allreduce.py), median of {args.reps}")
    print(format_table(["bytes", "gloo us", "gloo bus GB/s", "shm us", "shm bus GB/s"], rows))
    link_a, link_b = fit_allreduce(list(table), [g for g, _ in table.values()], args.ranks)
    shm_a, shm_b = fit_allreduce(list(table), [m for _, m in table.values()], args.ranks)
    print(f"ring fit: gloo a = {link_a * 1e6:.1f} us per hop, b = {link_b / 1e9:.2f} GB/s; "
          f"shm a = {shm_a * 1e6:.1f} us, b = {shm_b / 1e9:.2f} GB/s; "
          f"step-input broadcast ({bcast_bytes} B pickled): {bcast_s * 1e6:.0f} us")

    sample_bytes = (64 if args.quick else 512) << 20
    node_bw = ReadBandwidthSampler(sample_bytes, 0.2).sample()
    torch.set_num_threads(1)
    core_bw = ReadBandwidthSampler(sample_bytes, 0.2).sample()
    core_flops = measure_gemm_peak_flops(256 if args.quick else 1024, reps=3)
    torch.set_num_threads(cores)
    print(f"\nweights: {weight_bytes:.3f} bytes per matmul parameter "
          f"(--quantization {args.quantization})")
    print(f"\nmachine: {cores} cores, read {node_bw / 1e9:.1f} GB/s (all), "
          f"{core_bw / 1e9:.1f} GB/s (one core), {core_flops / 1e9:.1f} GFLOP/s per core")
    gloo_box = ClusterSpec(nodes=1, cores_per_node=cores, node_mem_bw=node_bw,
                           core_mem_bw=core_bw, core_flops=core_flops, link_latency=link_a,
                           link_bw=min(link_b, 1e12))
    # what the engine's local ranks use: all-reduces in shared memory, the rest over gloo
    box = dataclasses.replace(gloo_box, reduce_latency=shm_a, reduce_bw=min(shm_b, 1e12))

    prompts = _prompts(args.batch, args.prompt_len, source.config.vocab_size)
    context = args.prompt_len + args.output_len // 2
    common = dict(max_model_len=max(256, args.prompt_len + args.output_len + 8),
                  kv_cache_memory="256MiB", quantization=args.quantization)
    runs = {
        "TP=1": run_engine(args.model, common, prompts, args.output_len),
        "TP=1, Python layers": run_engine(args.model, common, prompts, args.output_len,
                                          python_layers=True),
        "TP=2": run_engine(args.model, {**common, "tensor_parallel_size": 2}, prompts,
                           args.output_len),
        "TP=2, gloo all-reduce": run_engine(args.model, {**common, "tensor_parallel_size": 2},
                                            prompts, args.output_len, all_reduce="gloo"),
        "DP=2": run_data_parallel(args.model, {**common, "num_threads": max(1, cores // 2)},
                                  prompts, args.output_len, 2),
    }
    steps = args.output_len - 1
    measured_step = {k: s / steps for k, (_, s) in runs.items()}
    # the engine's per-step overhead, calibrated where the model has no comm to predict
    stack = box.with_overhead(measured_step["TP=1"]
                              - step_cost(shape, args.batch, context, box).compute)
    python = box.with_overhead(measured_step["TP=1, Python layers"]
                               - step_cost(shape, args.batch, context, box).compute)
    predicted = {"TP=1": step_cost(shape, args.batch, context, stack),
                 "TP=1, Python layers": step_cost(shape, args.batch, context, python),
                 "TP=2": step_cost(shape, args.batch, context, python, tp=2),
                 "TP=2, gloo all-reduce": step_cost(
                     shape, args.batch, context,
                     dataclasses.replace(python, reduce_latency=None, reduce_bw=None), tp=2),
                 "DP=2": step_cost(shape, args.batch, context, stack, dp=2)}
    rows, results = [], {}
    for name, (tokens, seconds) in runs.items():
        p = predicted[name]
        dp = 2 if name.startswith("DP") else 1
        predicted_rate = dp * p.batch / p.seconds
        rows.append([name, tokens / seconds, predicted_rate, measured_step[name] * 1e3,
                     p.compute * 1e3, p.comm * 1e3, p.overhead * 1e3])
        results[name] = dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds,
                             predicted_tok_s=predicted_rate, compute_s=p.compute, comm_s=p.comm,
                             overhead_s=p.overhead)
    print(f"\ndecode, batch {args.batch}, prompt {args.prompt_len}, output {args.output_len} "
          f"(TP=1 rows calibrate the overhead; TP=2, DP=2 predicted)")
    print(format_table(["config", "tok/s", "model tok/s", "ms/step", "model compute ms",
                        "model comm ms", "model overhead ms"], rows))

    cluster = ClusterSpec(nodes=args.nodes, cores_per_node=args.cores_per_node,
                          node_mem_bw=node_bw * args.cores_per_node / cores, core_mem_bw=core_bw,
                          core_flops=core_flops, link_latency=link_a, link_bw=min(link_b, 1e12),
                          net_latency=args.net_latency_us * 1e-6, net_bw=args.net_gbps / 8 * 1e9,
                          step_overhead=python.step_overhead, reduce_latency=shm_a,
                          reduce_bw=min(shm_b, 1e12))
    n = args.nodes
    what_if = []
    for tp, dp in dict.fromkeys(((1, 1), (n, 1), (1, n), (2, max(1, n // 2)))):
        try:
            p = step_cost(shape, args.batch * dp, context, cluster, tp=tp, dp=dp)
        except ValueError as e:
            what_if.append([f"TP={tp} DP={dp}", str(e), "", ""])
            continue
        what_if.append([f"TP={tp} DP={dp}", dp * p.batch / p.seconds, p.seconds * 1e3,
                        p.comm * 1e3])
    print(f"\nwhat-if: {n} nodes x {args.cores_per_node} cores, {args.net_gbps:g} Gbit/s, "
          f"{args.net_latency_us:g} us per hop (batch {args.batch} per replica; the node "
          f"bandwidth scaled from this machine's per core)")
    print(format_table(["layout", "model tok/s", "ms/step", "comm ms"], what_if))
    print(f"\nSUMMARY distributed: all-reduce gloo a={link_a * 1e6:.1f}us "
          f"b={link_b / 1e9:.2f}GB/s, shm a={shm_a * 1e6:.1f}us | " + " | ".join(
              f"{k} {v['tok_s']:.1f} tok/s (model {v['predicted_tok_s']:.1f})"
              for k, v in results.items()))
    if args.json:
        write_json(args.json, {"allreduce_seconds_gloo_shm": table, "ring_a": link_a, "ring_b": link_b,
                               "shm_a": shm_a, "shm_b": shm_b,
                               "broadcast_object_seconds": bcast_s, "node_bw": node_bw,
                               "core_bw": core_bw, "core_flops": core_flops, "runs": results,
                               "what_if": what_if})
    return 0


if __name__ == "__main__":
    sys.exit(main())
