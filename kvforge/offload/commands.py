"""CLI: the offload engine flags and ``kvforge offload calibrate``."""
from __future__ import annotations

import argparse


def add_offload_engine_args(g) -> None:
    g.add_argument("--offload-memory-budget", default=None, metavar="SIZE",
                   help="turn on offloading (FlexGen): RAM for weights, KV and activations, "
                        "e.g. 512MiB; the rest streams from --offload-dir")
    g.add_argument("--offload-dir", default=None,
                   help="disk tier for weights and KV (default ~/.cache/kvforge/offload)")
    g.add_argument("--offload-policy", default="lp",
                   help="lp (placement chosen by a linear program), naive (one batch, every "
                        "layer read every step) or w=PCT[,kv=PCT] (layers whose weights / KV "
                        "stay in RAM)")
    g.add_argument("--offload-batch-size", type=int, default=8,
                   help="sequences computed together (FlexGen's GPU batch)")
    g.add_argument("--offload-block-batches", type=int, default=None,
                   help="batches per block sharing one weight load (default: the policy's)")
    g.add_argument("--offload-trace", default=None, metavar="FILE",
                   help="write a Chrome trace (load / compute / store lanes) at shutdown")


def cmd_calibrate(args: argparse.Namespace) -> int:
    import os

    import torch

    from kvforge.offload.calibrate import load_or_measure
    from kvforge.offload.config import DEFAULT_OFFLOAD_DIR
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = os.path.expanduser(args.offload_dir or DEFAULT_OFFLOAD_DIR)
    hw, measured = load_or_measure(directory, refresh=not args.cached)
    print(f"offload calibration ({'measured' if measured else 'cached'}; disk tier {directory}):")
    print(f"  disk reads  {hw.disk_read_bytes_per_s / 1e6:8.0f} MB/s (direct)")
    print(f"  disk writes {hw.disk_write_bytes_per_s / 1e6:8.0f} MB/s (synced)")
    print(f"  KV block write-back {hw.disk_block_write_s * 1e6:8.0f} us per block plane (direct)")
    print(f"  RAM reads   {hw.memory_bytes_per_s / 1e6:8.0f} MB/s")
    for rows, s in sorted(hw.linear_s_per_mparam.items()):
        print(f"  linear, {rows:4d} rows: {s * 1e3:7.3f} ms per million fp32 weights")
    print(f"  per layer call overhead: {hw.per_layer_call_s * 1e6:.0f} us")
    print(f"  reads beside compute {hw.disk_read_beside_compute_bytes_per_s / 1e6:8.0f} MB/s; "
          f"compute beside reads {hw.compute_contended_slowdown:.2f}x its time alone")
    if args.model is not None or args.budget is not None:
        _print_policy(args, hw)
    return 0


def _print_policy(args, hw) -> None:
    """The placement the policy would choose for a model under a budget (no generation)."""
    import torch

    from kvforge.config import parse_bytes
    from kvforge.loader.source import load_model_source
    from kvforge.models.registry import get_model_class
    from kvforge.offload.config import DEFAULT_OFFLOAD_DIR
    from kvforge.offload.cost_model import Workload
    from kvforge.offload.policy import choose_placement, parse_policy
    from kvforge.offload.runner import model_facts
    from kvforge.offload.store_builder import ensure_store
    from kvforge.offload.weight_store import WeightStore, store_key
    import os
    source = load_model_source(args.model or None)
    directory = os.path.join(os.path.expanduser(args.offload_dir or DEFAULT_OFFLOAD_DIR),
                             f"store-{store_key(source.path, 'none', 'float32')}")
    ensure_store(source.path, directory, "float32")
    store = WeightStore(directory)
    skeleton = get_model_class(source.config.architecture)(source.config, dtype=torch.float32)
    facts = model_facts(skeleton, store)
    placement = choose_placement(parse_policy(args.policy), facts, hw,
                                 Workload(args.seq_len, 2048), parse_bytes(args.budget or "512MiB"),
                                 args.batch_size, None)
    print(placement.describe())


def add_offload_commands(sub) -> None:
    p = sub.add_parser("offload", help="offloading tools")
    off = p.add_subparsers(dest="offload_command", required=True)
    c = off.add_parser("calibrate", help="measure the disk tier and compute rates the offload "
                                         "policy's cost model uses (cached per machine)")
    c.add_argument("--offload-dir", default=None)
    c.add_argument("--cached", action="store_true", help="print the cached constants if any")
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--model", default=None, help="also print the placement for this model")
    c.add_argument("--budget", default=None, help="... under this budget (default 512MiB)")
    c.add_argument("--policy", default="lp")
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--seq-len", type=int, default=512, help="tokens per sequence to plan for")
    c.set_defaults(func=cmd_calibrate)
