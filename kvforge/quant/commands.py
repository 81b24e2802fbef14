"""CLI: ``kvforge quantize MODEL --quantization int4 --out DIR`` and
``kvforge eval perplexity [MODEL] --quantization ... --corpus shakespeare --max-tokens N``."""
from __future__ import annotations

import argparse
import time
from typing import Any


def parse_key_values(items: list[str] | None) -> dict[str, Any] | None:
    """["group_size=128", "lm_head=none"] -> {"group_size": 128, "lm_head": "none"}."""
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"quantization argument {item!r} is not KEY=VALUE")
        try:
            out[key] = int(value)
        except ValueError:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def _load(args):
    import torch
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    source = load_model_source(args.model)
    model = load_model(source, quantization=args.quantization,
                       quantization_args=parse_key_values(args.quantization_arg))
    return source, model


def cmd_quantize(args: argparse.Namespace) -> int:
    from kvforge.quant.loading import weight_bytes
    from kvforge.quant.serialize import save_quantized
    if args.quantization in (None, "", "none"):
        from kvforge.quant.base import available_quantizations
        raise ValueError(f"kvforge quantize needs --quantization, one of "
                         f"{available_quantizations()}")
    t0 = time.perf_counter()
    source, model = _load(args)
    save_quantized(model, source, args.out)
    print(f"saved {args.quantization} model to {args.out} ({weight_bytes(model) / 2**20:.1f} MiB "
          f"of weights, {time.perf_counter() - t0:.1f} s); run it with --model {args.out}")
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from kvforge.eval.corpus import load_corpus
    from kvforge.eval.perplexity import perplexity
    source, model = _load(args)
    ids = source.load_tokenizer().encode(load_corpus(args.corpus), add_special_tokens=False)
    masks = None
    if args.activation_sparsity > 0:       # every token masked as sparse decode masks it
        from kvforge.sparsity.eval import sparsity_masks
        masks = sparsity_masks(model, source, args)
    if args.early_exit_threshold is not None:   # every position exits as a decode would
        from kvforge.exit.model import EarlyExitLM
        from kvforge.exit.store import load_heads_for
        model = EarlyExitLM(model, load_heads_for(model, source.path), args.early_exit_threshold,
                            exit_all_rows=True)
    r = perplexity(model, ids, max_tokens=args.max_tokens, window=args.window)
    print(f"perplexity {r.perplexity:.4f} (mean NLL {r.mean_nll:.4f}) over {r.num_scored} tokens "
          f"in {r.num_windows} windows; corpus {args.corpus}, quantization {args.quantization}")
    if masks is not None:
        from kvforge.sparsity.eval import describe_realised
        print(describe_realised(model, masks, args))
    if args.early_exit_threshold is not None:
        from kvforge.exit.model import describe_exits
        print(describe_exits(model.stats))
    return 0


def _model_args(p: argparse.ArgumentParser, positional: bool) -> None:
    if positional:
        p.add_argument("model", nargs="?", default=None,
                       help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--quantization", default="none")
    p.add_argument("--quantization-arg", action="append", default=None, metavar="KEY=VALUE")
    p.add_argument("--num-threads", type=int, default=None)


def add_quant_commands(sub, add_engine_args=None) -> None:
    p = sub.add_parser("quantize", help="quantize a model and save it (reload: --model DIR)")
    _model_args(p, positional=True)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=cmd_quantize)
    p = sub.add_parser("eval", help="model quality evaluation")
    ev = p.add_subparsers(dest="eval_command", required=True)
    p = ev.add_parser("perplexity", help="perplexity over a fixed corpus")
    _model_args(p, positional=True)
    p.add_argument("--corpus", default="shakespeare", help="shakespeare, sharegpt or a text file")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    from kvforge.sparsity.commands import add_sparsity_args
    add_sparsity_args(p)
    from kvforge.exit.commands import add_early_exit_args
    add_early_exit_args(p)
    p.set_defaults(func=cmd_perplexity)
