"""CLI: ``kvforge tune [MODEL]``: time the fp32 projection kernels for MODEL's shapes on this
CPU again (kernels/tune.py) and print the choice per row range; for a GGUF model also the row
count from which each of its block types takes its many-row kernel, int8 panels or fp32 tiles
(kernels/gguf_tiles.py)."""
from __future__ import annotations

import argparse


def model_shapes(model_path: str | None, max_rows: int, head_rows: int, packed: bool
                 ) -> list[tuple[int, int, bool, int]]:
    """(in, out, packed, rows) of the model's projections, read from its config (no weights)."""
    from kvforge.layers.linear import Linear
    from kvforge.loader.source import load_model_source
    from kvforge.models.registry import get_model_class
    source = load_model_source(model_path)
    model = get_model_class(source.config.architecture)(source.config, device="meta")
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[int, int, bool], int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            key = (module.input_size, module.output_size, packed)
            shapes[key] = max(shapes.get(key, 0), head_rows if module is head else max_rows)
    return [(*k, v) for k, v in shapes.items()]


def cmd_tune(args: argparse.Namespace) -> int:
    import torch

    from kvforge.kernels import cpu_kernels
    from kvforge.kernels.ops import packing_pays
    from kvforge.kernels.tune import cache_path, describe, machine_line, tune_linear_shapes
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        torch.set_num_threads(args.num_threads)
    ops = cpu_kernels()
    if ops is None:
        raise ValueError("the compiled kernels are not available here (KVFORGE_KERNELS=0 or no "
                         "compiler): nothing to tune")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    shapes = model_shapes(args.model, max(args.max_num_seqs, args.max_num_batched_tokens),
                          args.max_num_seqs, packing_pays())
    print(machine_line())
    tunings = tune_linear_shapes(shapes, force=True)
    for line in describe(tunings):
        print(line)
    print(f"saved: {cache_path()}")
    for type_name, (rows, kernel) in gguf_crossovers(args.model).items():
        print(f"GGUF {type_name}: " + (f"{KERNEL_NAMES[kernel]} from {rows} rows" if rows
                                       else "integer kernels at every row count"))
    return 0


KERNEL_NAMES = {"panels": "int8 panels", "tiles": "fp32 tiles + GEMM"}


def gguf_crossovers(model_path: str | None) -> dict[str, tuple[int, str]]:
    """A GGUF model's block types timed again for their many-row kernel and its crossover
    (kernels/gguf_tiles.py): {type: (rows, kernel)}; {} for other models."""
    from kvforge.kernels.gguf_tiles import retune
    from kvforge.loader.source import load_model_source
    source = load_model_source(model_path)
    if source.format != "gguf":
        return {}
    return retune(t.tensor_type.name for t in source.gguf_reader().tensors)


def add_tune_command(sub) -> None:
    p = sub.add_parser("tune", help="time the fp32 projection kernels on this CPU again "
                                    "(the engine does it once per machine and model shapes)")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, HF directory or catalogue name (default model if omitted)")
    p.add_argument("--max-num-seqs", type=int, default=128,
                   help="rows the LM head is tuned for (sequences in a step)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="rows the layers are tuned for (tokens in a step; at most 256 tuned, "
                        "MKL beyond)")
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=cmd_tune)
