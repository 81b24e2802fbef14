"""Time from process start to the first token, by phase, in fresh processes.

    python benchmarks/startup.py                                   # the catalogue models on disk
    python benchmarks/startup.py --models smollm2-135m-instruct --rounds 4 \\
        --baseline ../kvforge-old --baseline-cache /tmp/old-cache  # against another checkout

Each round starts one process per model (and per checkout, alternating): it imports torch,
builds ``LLM(model)`` with its defaults and generates one greedy token of a short prompt.
The phases, from the process's start time in /proc:

    python      interpreter start-up until the script runs
    torch       ``import torch`` as kvforge's entry points do (``kvforge/torch_import.py``)
    engine      ``LLM(model)``: the GGUF header, the model (mapped blocks), the kernels'
                module, the tokenizer, the KV pool, the scheduler
    first token the first ``generate`` (the prompt's prefill, the pages it touches first)

``--baseline DIR`` runs another kvforge checkout's code (its own ``KVFORGE_CACHE_DIR``,
``--baseline-cache``, so the two never share kernel builds or tokenizer caches) in alternation
with this one: a before / after of start-up work on the same machine and minute. The first
round of each checkout is a warm-up (kernel builds, tokenizer conversion) and is not counted.
The table gives medians; one ``SUMMARY`` line.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("python", "torch", "engine", "first token")
PROMPT = "Write a haiku about the sea."


def _since_start() -> float:
    """Seconds since this process started (its start time in /proc, in clock ticks)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start / os.sysconf("SC_CLK_TCK")


def worker(model: str, checkout: str | None) -> None:
    t_main = _since_start()
    if checkout:            # another checkout's kvforge, not this environment's editable install
        sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, checkout)
    try:                    # as kvforge's entry points import it (collector paused, frozen)
        from kvforge.torch_import import import_torch_frozen
    except ImportError:     # a checkout from before kvforge/torch_import.py: a plain import
        def import_torch_frozen():
            importlib.import_module("torch")
    import_torch_frozen()
    t_torch = _since_start()
    from kvforge import LLM, SamplingParams
    llm = LLM(model)
    t_engine = _since_start()
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    t_first = _since_start()
    print("RESULT " + json.dumps({"python": t_main, "torch": t_torch - t_main,
                                  "engine": t_engine - t_torch, "first token": t_first - t_engine,
                                  "total": t_first}))


def run_worker(model: str, checkout: str | None, cache: str | None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)    # bytecode cached, as in a user's install
    if cache:
        env["KVFORGE_CACHE_DIR"] = cache
    args = [sys.executable, os.path.abspath(__file__), "--worker", model]
    if checkout:
        args += ["--checkout", checkout]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"start-up of {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(next(line for line in done.stdout.splitlines()
                           if line.startswith("RESULT "))[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=None,
                   help="catalogue names or GGUF paths (default: the catalogue models on disk)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", default=None, help="another kvforge checkout to alternate with")
    p.add_argument("--baseline-cache", default=None,
                   help="its KVFORGE_CACHE_DIR (default: BASELINE/.kvforge-cache)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--checkout", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.checkout)
        return
    from benchmarks.hardware import hardware_line
    from benchmarks.report import format_table
    from kvforge.loader.catalog import CATALOG, pulled_path, resolve_model
    names = args.models or [n for n, e in CATALOG.items() if pulled_path(e) is not None]
    # paths, resolved here: a baseline with a cache of its own would not find the catalogue's
    models = {name: os.path.abspath(resolve_model(name)) for name in names}
    systems = {"kvforge": (None, None)}
    if args.baseline:
        systems["baseline"] = (os.path.abspath(args.baseline), os.path.abspath(
            args.baseline_cache or os.path.join(args.baseline, ".kvforge-cache")))
    runs = {(s, n): [] for s in systems for n in models}
    for r in range(args.rounds + 1):
        for name, path in models.items():
            for system, (checkout, cache) in systems.items():
                result = run_worker(path, checkout, cache)
                if r > 0:                                   # round 0 warms the caches
                    runs[(system, name)].append(result)
        print(f"  round {r}{' (warm-up)' if r == 0 else ''} done", flush=True)
    rows, summary = [], []
    for name in models:
        for system in systems:
            med = {k: statistics.median(x[k] for x in runs[(system, name)])
                   for k in (*PHASES, "total")}
            rows.append([name, system] + [f"{med[k]:.2f}" for k in (*PHASES, "total")])
        total = {s: statistics.median(x["total"] for x in runs[(s, name)]) for s in systems}
        summary.append(f"{name} {total['kvforge']:.2f} s" + (
            f" (baseline {total['baseline']:.2f} s, {total['baseline'] / total['kvforge']:.2f}x)"
            if "baseline" in total else ""))
    print(f"\n== process start to first token, seconds (medians of {args.rounds} rounds)")
    print(format_table(["model", "code", *PHASES, "total"], rows))
    print("\n" + hardware_line())
    print("SUMMARY startup: " + "; ".join(summary))


if __name__ == "__main__":
    main()
