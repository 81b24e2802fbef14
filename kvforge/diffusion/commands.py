"""CLI: ``kvforge train-diffusion [--output DIR]``: a small masked-diffusion LM, saved as an HF
directory (LLaDA layout, byte tokenizer) that ``--model`` / ``LLM(...)`` load by path or by
its name under the models directory."""
from __future__ import annotations

import argparse
import json
import os
import time

DEFAULT_NAME = "tiny-diffusion"


def save_model(model, directory: str, report: dict) -> None:
    """config.json + model.safetensors + tokenizer files + training.json, written to a
    temporary directory and renamed into place (a half-written model never looks loadable)."""
    from safetensors.torch import save_file
    from kvforge.diffusion.byte_tokenizer import save_byte_tokenizer
    tmp = f"{directory}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model.config.to_llada_dict(), f, indent=2)
    save_file(model.llada_state_dict(), os.path.join(tmp, "model.safetensors"))
    save_byte_tokenizer(tmp)
    with open(os.path.join(tmp, "training.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    if os.path.isdir(directory):
        old = f"{directory}.old{os.getpid()}"
        os.replace(directory, old)
        os.replace(tmp, directory)
        import shutil
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)


def cmd_train_diffusion(args: argparse.Namespace) -> int:
    import torch
    from kvforge.diffusion.train import DiffusionTraining, train
    from kvforge.loader.catalog import models_dir
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    opts = DiffusionTraining(hidden_size=args.hidden_size, num_layers=args.layers,
                             num_heads=args.heads, intermediate_size=args.intermediate_size,
                             seq_len=args.seq_len, batch=args.batch, steps=args.steps, lr=args.lr,
                             max_minutes=args.max_minutes, seed=args.seed)
    t0 = time.perf_counter()
    model, report = train(opts)
    directory = os.path.abspath(args.output or os.path.join(models_dir(), DEFAULT_NAME))
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    save_model(model, directory, report)
    print(f"{report['parameters'] / 1e6:.2f}M parameters, {report['steps']} steps in "
          f"{report['seconds']:.0f} s on {report['threads']} threads; held-out diffusion loss "
          f"{report['held_out_loss_before']:.3f} -> {report['held_out_loss_after']:.3f} "
          f"(nats/byte bound); total {time.perf_counter() - t0:.0f} s; saved to {directory}")
    return 0


def add_train_diffusion_command(sub) -> None:
    p = sub.add_parser("train-diffusion",
                       help="train a small masked-diffusion LM on The Tempest + ShareGPT (CPU)")
    p.add_argument("--output", default=None,
                   help=f"model directory (default: <models dir>/{DEFAULT_NAME}, loadable as "
                        f"--model {DEFAULT_NAME})")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--max-minutes", type=float, default=25.0,
                   help="stop training when this time is up (the model is saved either way)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="bytes per sequence")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=704)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=cmd_train_diffusion)
