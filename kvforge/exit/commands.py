"""CLI: ``kvforge train-exit-heads [MODEL] [--layers E ...]`` and ``--early-exit-threshold P``
(engine commands and ``kvforge eval perplexity``)."""
from __future__ import annotations

import argparse
import time


def add_early_exit_args(p) -> None:
    p.add_argument("--early-exit-threshold", type=float, default=None, metavar="P",
                   help="lossy early exit: a decode token leaves the model at the first trained "
                        "exit head whose top-1 probability is >= P, in (0, 1] (heads from "
                        "`kvforge train-exit-heads`)")


def cmd_train(args: argparse.Namespace) -> int:
    import torch
    from kvforge.exit.heads import ExitHeads, default_exit_layers, validate_exit_layers
    from kvforge.exit.store import heads_dir, save_heads
    from kvforge.exit.train import ExitTraining, collect_streams, train_heads, training_tokens
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    t0 = time.perf_counter()
    source = load_model_source(args.model_opt or args.model)
    model = load_model(source, quantization="none")
    model.eval()
    from kvforge.models.layerwise import layerwise_family
    layerwise_family(type(model), "exit-head training")
    layers = validate_exit_layers(args.layers or default_exit_layers(model.num_layers),
                                  model.num_layers)
    opts = ExitTraining(tokens=args.tokens, epochs=args.epochs, batch=args.batch, lr=args.lr)
    ids = training_tokens(source.load_tokenizer(), opts.tokens)
    streams, final = collect_streams(model, ids, layers)
    heads = ExitHeads.for_model(model, layers)
    report = train_heads(model, heads, streams, final, opts)
    directory = heads_dir(source.path)
    save_heads(heads, directory, {"tokens": len(ids), "epochs": opts.epochs, "lr": opts.lr,
                                  "corpus": "tempest+sharegpt", "held_out": report["after"],
                                  "untrained": report["before"]})
    print(f"{'exit after':>10}  {'KL before':>9}  {'KL after':>8}  {'top-1 agree before':>18}  "
          f"{'after':>6}")
    for e in layers:
        b, a = report["before"][e], report["after"][e]
        print(f"{e:>10}  {b['kl']:9.3f}  {a['kl']:8.3f}  {b['agree']:18.1%}  {a['agree']:6.1%}")
    print(f"trained on {len(ids)} tokens in {time.perf_counter() - t0:.0f} s; saved to "
          f"{directory}")
    return 0


def add_train_command(sub) -> None:
    p = sub.add_parser("train-exit-heads",
                       help="train early-exit heads for a model by distillation and cache them")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, HF directory or catalogue name (default: SmolLM2-135M)")
    p.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    p.add_argument("--layers", type=int, nargs="+", default=None, metavar="E",
                   help="exit after the first E layers, one head each (default: 1/4, 1/2, 5/8 "
                        "and 3/4 of the layers)")
    p.add_argument("--tokens", type=int, default=32768,
                   help="training tokens (hidden states kept in memory: tokens x d x 4 B per "
                        "exit layer)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=128, help="tokens per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=cmd_train)
