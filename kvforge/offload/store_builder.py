"""Build an offload weight store in a process of its own, so the serving process never holds
the whole model: ``python -m kvforge.offload.store_builder MODEL OUT_DIR [--dtype float32]``."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch


def ensure_store(source_path: str, directory: str, dtype: str, quantization: str = "none") -> float:
    """Build the store at ``directory`` unless it is complete; returns seconds spent building."""
    from kvforge.offload.weight_store import MANIFEST
    if os.path.exists(os.path.join(directory, MANIFEST)):
        return 0.0
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "kvforge.offload.store_builder", source_path, directory,
           "--dtype", dtype, "--quantization", quantization]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the offload weight store failed:\n{proc.stderr[-4000:]}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    args = p.parse_args(argv)
    from kvforge.loader.source import load_model_source
    from kvforge.offload.weight_store import build_store
    from kvforge.quant.loading import load_model
    source = load_model_source(args.model)
    with torch.inference_mode():
        model = load_model(source, quantization=args.quantization, dtype=getattr(torch, args.dtype))
    build_store(model, args.out, {"model": source.path, "dtype": args.dtype,
                                  "quantization": args.quantization})
    return 0


if __name__ == "__main__":
    sys.exit(main())
