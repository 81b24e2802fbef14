"""kvforge vs llama.cpp on the same GGUF files, side by side on this machine.

Per model file, in fresh processes (so load time and peak RSS are each engine's own), kvforge
and llama.cpp alternate ``--rounds`` times; the table gives each engine's median and their
ratio:

- load: from process start of the engine to the first token of a 1-token prompt ready
- prefill: a 512-token prompt (The Tempest), tokens / s
- decode b1: 64 greedy tokens after a 20-token prompt, tokens / s (the prompt's time excluded)
- peak RSS after the batch-1 runs (kvforge also reports its KV pool, allocated up front)
- kvforge's aggregate decode at batch 8 and 32 (64 tokens each, prompts of 20 tokens;
  llama.cpp's batch-1 rate is the reference a user has)

Both engines get the same token ids and the same thread count (``--threads``, default: the
physical cores). kvforge runs with its defaults (``--quantization auto``: the file's own blocks).

llama.cpp is llama-cpp-python, built for this CPU in a separate virtual environment (it is
never a kvforge dependency):

    python3 -m venv ~/llamacpp-venv
    CMAKE_ARGS=-DGGML_NATIVE=ON ~/llamacpp-venv/bin/pip install --no-binary llama-cpp-python \\
        llama-cpp-python==0.3.36          # ~10 minutes
    .venv/bin/python benchmarks/gguf_vs_llamacpp.py --llama-python ~/llamacpp-venv/bin/python

Without it (no ``--llama-python``, nor ``KVFORGE_LLAMA_PYTHON``) only kvforge's columns are
filled. Models: catalogue names or GGUF paths (``--models``; default the default model and
qwen2.5-coder-1.5b-instruct, pulled on first use).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# kvforge's modules (and torch) are imported where used: the llama.cpp worker runs in a venv
# that has neither

PREFILL_TOKENS = 512
DECODE_PROMPT_TOKENS = 20
DECODE_TOKENS = 64

# ---- worker side: one engine, one process --------------------------------------------------


def _rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompts(path: str) -> dict:
    """Token ids every worker uses: the prefill prompt, decode prompts (distinct, so no prefix
    cache helps), from The Tempest through the model's own tokenizer."""
    from kvforge.eval.corpus import shakespeare_text
    from kvforge.loader.source import load_model_source
    ids = load_model_source(path).load_tokenizer().encode(shakespeare_text())
    n = DECODE_PROMPT_TOKENS
    return {"prefill": ids[1000:1000 + PREFILL_TOKENS],
            "decode": [ids[3000 + i * n:3000 + (i + 1) * n] for i in range(40)]}


def run_kvforge(path: str, threads: int, prompts: dict, batched: bool) -> dict:
    start = time.perf_counter()
    from kvforge import LLM, SamplingParams
    llm = LLM(path, num_threads=threads, enable_prefix_caching=False, max_model_len=2048)

    def generate(batch: list[list[int]], tokens: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t

    generate([prompts["decode"][0][:4]], 1)
    out = {"load_s": time.perf_counter() - start,
           "kv_pool_mib": sum(c.numel() * c.element_size()
                              for c in llm.engine.runner.kv_caches) / 2**20}
    decode = prompts["decode"]
    if not batched:
        out["prefill_tps"] = PREFILL_TOKENS / generate([prompts["prefill"]], 1)
        first = generate([decode[1]], 1)
        whole = generate([decode[2]], DECODE_TOKENS + 1)
        out["decode_tps"] = DECODE_TOKENS / max(whole - first, 1e-9)
        out["rss_mib"] = _rss_mib()
    else:
        for b in (8, 32):
            batch = decode[:b]
            first = generate(batch, 1)
            whole = generate(batch, DECODE_TOKENS + 1)
            out[f"b{b}_tps"] = b * DECODE_TOKENS / max(whole - first, 1e-9)
    return out


def run_llamacpp(path: str, threads: int, prompts: dict) -> dict:
    import numpy as np
    start = time.perf_counter()
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=2048, n_batch=PREFILL_TOKENS, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def run(prompt: list[int], tokens: int) -> float:
        """Prompt, then `tokens` greedy tokens (argmax of the last logits); seconds."""
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        for _ in range(tokens - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return time.perf_counter() - t

    run(prompts["decode"][0][:4], 1)
    out = {"load_s": time.perf_counter() - start}
    out["prefill_tps"] = PREFILL_TOKENS / run(prompts["prefill"], 1)
    first = run(prompts["decode"][1], 1)
    whole = run(prompts["decode"][2], DECODE_TOKENS + 1)
    out["decode_tps"] = DECODE_TOKENS / max(whole - first, 1e-9)
    out["rss_mib"] = _rss_mib()
    return out


def worker_main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    prompts = spec["prompts"]
    if spec["engine"] == "llama.cpp":
        result = run_llamacpp(spec["path"], spec["threads"], prompts)
    else:
        result = run_kvforge(spec["path"], spec["threads"], prompts, spec["batched"])
    print("RESULT " + json.dumps(result), flush=True)


# ---- driver ------------------------------------------------------------------------------


def _run_worker(python: str, spec: dict) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(spec["threads"]))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root if spec["engine"] == "kvforge" else ""
    # bytecode cached as in a user's install (a shell that turns the cache off would time the
    # compiling of kvforge's modules in every load)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([python, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env, cwd=root)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{spec['engine']} worker failed (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")


def _median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2:])
    from benchmarks.hardware import hardware_line, physical_cores
    from benchmarks.report import format_table, write_json
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+",
                        default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--llama-python", default=os.environ.get("KVFORGE_LLAMA_PYTHON"),
                        help="python of a venv with llama-cpp-python (see the module doc)")
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.llama_python:
        print("llama.cpp: not given (--llama-python PATH or KVFORGE_LLAMA_PYTHON); how to "
              "build it: see this script's docstring. kvforge columns only.")
    from kvforge.loader.catalog import resolve_model
    rows, payload = [], {"models": {}}
    for model in args.models:
        path = resolve_model(model)
        prompts = _prompts(path)
        spec = {"path": path, "threads": args.threads, "prompts": prompts, "batched": False}
        kv, ll = [], []
        for _ in range(args.rounds):        # alternating: drift hits both engines alike
            kv.append(_run_worker(sys.executable, dict(spec, engine="kvforge")))
            if args.llama_python:
                ll.append(_run_worker(args.llama_python, dict(spec, engine="llama.cpp")))
        batched = [] if args.skip_batched else [
            _run_worker(sys.executable, dict(spec, engine="kvforge", batched=True))]
        name = os.path.basename(path)
        summary = {"kvforge": kv, "llama.cpp": ll, "kvforge_batched": batched}
        payload["models"][name] = summary
        llama_decode = _median(ll, "decode_tps")
        for metric, key, unit in (("load", "load_s", "s"), ("prefill 512", "prefill_tps", "tok/s"),
                                  ("decode b1", "decode_tps", "tok/s"),
                                  ("peak RSS", "rss_mib", "MiB")):
            a, b = _median(kv, key), _median(ll, key)
            ratio = (b / a if key == "load_s" else a / b) if a and b else None
            rows.append([name, f"{metric} ({unit})", a, b,
                         f"{ratio:.2f}x" if ratio else "-"])
        rows.append([name, "kvforge KV pool (MiB)", _median(kv, "kv_pool_mib"), None, "-"])
        for b in (8, 32):
            agg = _median(batched, f"b{b}_tps")
            if agg is not None:
                rows.append([name, f"decode b{b} aggregate (tok/s)", agg, None,
                             f"{agg / llama_decode:.2f}x llama.cpp b1" if llama_decode else "-"])
    print(format_table(["model", "metric", "kvforge", "llama.cpp", "kvforge advantage"], rows))
    print("(advantage: kvforge / llama.cpp for rates, llama.cpp / kvforge for load time; "
          f"medians of {args.rounds} alternating rounds)")
    if args.json:
        write_json(args.json, payload)
    decode = [r for r in rows if r[1].startswith("decode b1")]
    print("SUMMARY gguf_vs_llamacpp: " + "; ".join(f"{r[0]} decode b1 {r[4]}" for r in decode)
          + f" | {hardware_line()}")


if __name__ == "__main__":
    main()
