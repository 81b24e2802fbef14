"""FlexGen-style offloading (kvforge/offload) vs the naive policy, HF Accelerate's disk offload
and the model fully in memory.

Workload (FlexGen's): ``--prompts`` prompts of ~32 tokens, ``--output-tokens`` greedy tokens
each (EOS ignored), the fp32 model under ``--budget`` of RAM for weights, KV and activations.
Each system runs in a child process of its own, so peak RSS and ``/proc/self/io`` read bytes
are its own. Reported per system: end-to-end tok/s (prefill included), decode tok/s (all-decode
steps only), peak RSS, bytes read from storage per generated token, the loader's overlap
fraction, the LP's predicted decode tok/s (for the steps the run made: a step of n sequences
fills ceil(n / batch) of the block's batches; the hardware constants are measured again before
the first round unless ``--cached-calibration``). The naive policy and Accelerate run the first
``--naive-prompts`` / ``--accelerate-prompts`` prompts: both run one batch at a time, so their
throughput does not depend on how many batches follow (a full 128-prompt run would only take
longer). Greedy tokens of every offloaded run are compared with the in-memory run's.

Accelerate runs twice. The disk row drops the files its offloaded weights are read from (the
offload folder and the checkpoint's safetensors) from the page cache before every forward, so
it pays the disk as kvforge's O_DIRECT tiers do; the page-cache row does not (its first forward
reads the disk, the later ones RAM at page-cache speed). Both start with a cold page cache.

``--grid`` also measures decode tok/s over block sizes and placements (explicit policies) and
reports the LP's choice against the best of them.

    .venv/bin/python benchmarks/offload.py --rounds 3 --grid      # ~6 min on 2 cores, quiet box
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table  # noqa: E402

TOPICS = ["harbour", "mountain", "library", "garden", "factory", "desert", "forest", "market"]


def make_prompts(n: int) -> list[str]:
    return [f"Robot number {i} lived near the {TOPICS[i % len(TOPICS)]}. Every morning it "
            f"walked out, counted what it saw and wrote a short poem about it. Today the "
            f"robot wrote:" for i in range(n)]


def proc_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- children
def child_runtime(cfg: dict) -> dict:
    """The fixed overhead: interpreter, torch, kvforge, tokenizer, kernels; no weights."""
    import torch  # noqa: F401
    from kvforge.engine.llm_engine import LLMEngine  # noqa: F401
    from kvforge.kernels import cpu_kernels
    from kvforge.loader.source import load_model_source
    source = load_model_source(cfg["model"])
    source.load_tokenizer()
    cpu_kernels()
    return {"peak_rss": peak_rss()}


def time_decode_steps(runner) -> list[tuple[int, float]]:
    """(tokens, seconds) of every all-decode engine step, appended as the runner executes
    them: the same decode measure for the offloaded and the in-memory systems."""
    steps: list[tuple[int, float]] = []
    execute = runner.execute

    def timed(sched):
        decode = bool(sched.scheduled) and all(r.num_computed_tokens >= r.num_prompt_tokens
                                               for r in sched.scheduled)
        start = time.perf_counter()
        out = execute(sched)
        if decode:          # multi-step decoding (in memory) samples several tokens per row
            steps.append((sum(len(t) for t in out.sampled.values()),
                          time.perf_counter() - start))
        return out

    runner.execute = timed
    return steps


def child_kvforge(cfg: dict) -> dict:
    from kvforge import LLM, SamplingParams
    kwargs = dict(quantization=cfg.get("quantization", "none"), max_model_len=cfg["max_model_len"],
                  num_threads=cfg["threads"], enable_prefix_caching=False)
    if cfg["policy"] != "memory":
        kwargs.update(offload_memory_budget=cfg["budget"], offload_dir=cfg["offload_dir"],
                      offload_policy=cfg["policy"], offload_batch_size=cfg["batch_size"],
                      offload_block_batches=cfg.get("block_batches"))
    else:
        kwargs.update(kv_cache_memory="1GiB")
    llm = LLM(cfg["model"], **kwargs)
    decode_steps = time_decode_steps(llm.engine.runner)
    start_rss = current_rss()          # the engine started: no weights touched yet (offload)
    prompts = make_prompts(cfg["prompts"])
    params = SamplingParams(temperature=0, max_tokens=cfg["output_tokens"], ignore_eos=True)
    read0 = proc_read_bytes()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    n_tokens = sum(len(t) for t in tokens)
    result = {"tok_s": n_tokens / seconds, "seconds": seconds, "tokens": tokens,
              "quantization": llm.engine.config.quantization,
              "proc_read_per_token": (proc_read_bytes() - read0) / n_tokens,
              "peak_rss": peak_rss(), "start_rss": start_rss,
              "decode_tok_s": sum(n for n, _ in decode_steps) / max(
                  sum(t for _, t in decode_steps), 1e-9)}
    runner = llm.engine.runner
    if cfg["policy"] != "memory":
        model = runner.model
        result.update(
            read_per_token=model.bytes_read / n_tokens,
            written_per_token=model.bytes_written / n_tokens,
            overlap=model.trace.overlap_fraction(),
            # the cost model's decode tok/s for the steps this run made (a step of n
            # sequences fills ceil(n / batch) batches of the block), and for a full block
            predicted_decode_tok_s=sum(n for n, _ in decode_steps) / max(
                sum(runner.predicted_decode_step_s(n) for n, _ in decode_steps), 1e-9),
            predicted_block_tok_s=runner.placement.predicted_tokens_per_s,
            placement=runner.placement.describe(),
            block_batches=runner.placement.block_batches,
            counts=list(runner.placement.counts),
            disk_read_mb_s=runner.hardware.disk_read_bytes_per_s / 1e6)
        if cfg.get("trace"):
            model.trace.write(cfg["trace"])
        llm.engine.shutdown()
    return result


def hf_dir_of(model_path: str, cache_dir: str) -> str:
    """The GGUF model as an fp32 HF directory (what Accelerate loads), converted once."""
    out = os.path.join(cache_dir, "hf-" + os.path.basename(model_path).removesuffix(".gguf"))
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        # transformers will not save a GGUF-loaded model: write the same fp32 tensors kvforge
        # dequantizes (HF names) next to the GGUF's config and tokenizer
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer

        from kvforge.loader.source import load_model_source
        d, f = os.path.dirname(model_path), os.path.basename(model_path)
        os.makedirs(out, exist_ok=True)
        AutoConfig.from_pretrained(d, gguf_file=f).save_pretrained(out)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
        tensors = {name: t.float().contiguous()
                   for name, t in load_model_source(model_path).iter_weights()}
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def evict_from_page_cache(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (pages still mapped by a process stay), so the
    next read of them comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def accelerate_disk_files(folder: str, hf_dir: str) -> list[str]:
    """Where Accelerate's disk-offloaded weights are read from: its offload folder, and the
    checkpoint's safetensors files (weights already in safetensors are read from there, not
    copied into the folder)."""
    out = []
    for d, names in ((folder, os.listdir(folder) if os.path.isdir(folder) else []),
                     (hf_dir, [n for n in os.listdir(hf_dir) if n.endswith(".safetensors")])):
        out += [os.path.join(d, n) for n in names if os.path.isfile(os.path.join(d, n))]
    return out


def child_accelerate(cfg: dict) -> dict:
    """HF Accelerate's disk offload, starting with a cold page cache. With ``evict`` (the disk
    row) every forward starts with its offloaded weights' files dropped from the page cache, so
    it reads them from the disk as kvforge's tiers do (O_DIRECT); without, the page cache
    serves every forward after the first (RAM at ~6 GB/s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(cfg["threads"])
    hf_dir = cfg["hf_dir"]
    folder = os.path.join(cfg["offload_dir"], "accelerate")
    evict_from_page_cache(accelerate_disk_files(folder, hf_dir))
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, device_map="auto", max_memory={"cpu": cfg["budget"]}, offload_folder=folder,
        torch_dtype=torch.float32)
    files = accelerate_disk_files(folder, hf_dir)
    forwards = []

    def before_forward(module, args):
        forwards.append(1)
        if cfg["evict"]:
            evict_from_page_cache(files)

    model.register_forward_pre_hook(before_forward)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    prompts = make_prompts(cfg["prompts"])
    read0 = proc_read_bytes()
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), cfg["batch_size"]):
        enc = tok(prompts[i:i + cfg["batch_size"]], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=cfg["output_tokens"],
                                 min_new_tokens=cfg["output_tokens"], do_sample=False)
        tokens += out[:, enc["input_ids"].shape[1]:].tolist()
    seconds = time.perf_counter() - start
    n_tokens = sum(len(t) for t in tokens)
    read = proc_read_bytes() - read0
    placed, disk_bytes = {}, 0
    for name, v in getattr(model, "hf_device_map", {}).items():
        placed[str(v)] = placed.get(str(v), 0) + 1
        if str(v) == "disk":
            disk_bytes += sum(p.numel() * p.element_size()
                              for p in model.get_submodule(name).parameters())
    return {"tok_s": n_tokens / seconds, "seconds": seconds, "peak_rss": peak_rss(),
            "proc_read_per_token": read / n_tokens, "forwards": len(forwards),
            "read_per_forward": read / max(len(forwards), 1), "disk_weight_bytes": disk_bytes,
            "device_map": placed}


def child_hf_dir(cfg: dict) -> dict:
    return {"hf_dir": hf_dir_of(cfg["model"], cfg["offload_dir"])}


def child_calibrate(cfg: dict) -> dict:
    """``kvforge offload calibrate`` at the systems' thread count: the cost model's constants
    as the disk runs now (it drifts 2x between hours), cached for the engines that follow."""
    import torch
    from kvforge.offload.calibrate import load_or_measure
    torch.set_num_threads(cfg["threads"])
    hw, _ = load_or_measure(cfg["offload_dir"], refresh=True)
    return {"read": hw.disk_read_bytes_per_s,
            "read_beside": hw.disk_read_beside_compute_bytes_per_s,
            "slowdown": hw.compute_contended_slowdown}


CHILDREN = {"runtime": child_runtime, "kvforge": child_kvforge, "accelerate": child_accelerate,
            "hf_dir": child_hf_dir, "calibrate": child_calibrate}


def run_child(cfg: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child {cfg.get('kind')}/{cfg.get('policy')} failed:\n"
                       f"{proc.stderr[-3000:]}")


# ---------------------------------------------------------------- parent
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M)")
    p.add_argument("--budget", default="128MiB")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--naive-prompts", type=int, default=16)
    p.add_argument("--accelerate-prompts", type=int, default=8)
    p.add_argument("--accelerate-output-tokens", type=int, default=None,
                   help="tokens per Accelerate prompt (default: --output-tokens, the workload "
                        "every system runs; fewer favour kvforge, since Accelerate's prefill "
                        "forward then weighs more)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every system (default: the physical cores)")
    p.add_argument("--rounds", type=int, default=2,
                   help="each round runs every system once, in turn; the table shows each "
                        "system's median round, the ratios are medians of the rounds' ratios "
                        "(the disk's speed drifts between runs)")
    p.add_argument("--offload-dir", default=os.path.expanduser("~/.cache/kvforge/offload"))
    p.add_argument("--cached-calibration", action="store_true",
                   help="keep the cached `kvforge offload calibrate` constants (default: measure "
                        "them again first, so the LP's prediction is for the disk of this hour)")
    p.add_argument("--skip-accelerate", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--grid", action="store_true", help="also run the grid of placements")
    p.add_argument("--grid-only", action="store_true")
    p.add_argument("--grid-output-tokens", type=int, default=6)
    p.add_argument("--trace", default=None, help="Chrome trace of the lp run")
    p.add_argument("--quantization", default="none", choices=["none", "gguf"],
                   help="what kvforge streams and runs in memory: fp32 rows (none) or the GGUF "
                        "file's own blocks (gguf; adds 'lp fp32', the fp32 store at the same "
                        "budget); Accelerate always runs fp32")
    args = p.parse_args()
    if args.child:
        cfg = json.loads(args.child)
        print("RESULT " + json.dumps(CHILDREN[cfg["kind"]](cfg)), flush=True)
        return 0

    from kvforge.engine.threads import default_num_threads
    from kvforge.loader.source import load_model_source
    model_path = load_model_source(args.model).path
    threads = args.threads or default_num_threads()
    base = dict(model=model_path, budget=args.budget, max_model_len=args.max_model_len,
                threads=threads, offload_dir=args.offload_dir, batch_size=args.batch_size,
                output_tokens=args.output_tokens, quantization=args.quantization)
    print(hardware_line() + f" | systems run {threads} torch thread(s)")
    weights = "fp32" if args.quantization == "none" else "GGUF blocks"
    print(f"model {os.path.basename(model_path)} {weights}, budget {args.budget}, "
          f"{args.prompts} prompts x {args.output_tokens} tokens, batch {args.batch_size}, "
          f"{args.rounds} round(s)")
    if not args.cached_calibration:
        cal = run_child(dict(base, kind="calibrate"))
        print(f"calibrated now: direct reads {cal['read'] / 1e6:.0f} MB/s alone, "
              f"{cal['read_beside'] / 1e6:.0f} beside compute; compute beside reads "
              f"{cal['slowdown']:.2f}x", flush=True)
    overhead = run_child(dict(base, kind="runtime"))["peak_rss"]
    budget_bytes = _parse_bytes(args.budget)
    systems = {"lp": dict(base, kind="kvforge", policy="lp", prompts=args.prompts,
                          trace=args.trace),
               "naive": dict(base, kind="kvforge", policy="naive", prompts=args.naive_prompts)}
    if args.quantization != "none":
        systems["lp fp32"] = dict(base, kind="kvforge", policy="lp", prompts=args.prompts,
                                  quantization="none")
    if not args.skip_accelerate and not args.grid_only:
        # converted in a child: a child's peak RSS (getrusage) starts from its parent's RSS
        # at the fork, so the parent must not hold the model
        hf_dir = run_child(dict(base, kind="hf_dir"))["hf_dir"]
        for name, evict in (("accelerate (disk)", True), ("accelerate (page cache)", False)):
            systems[name] = dict(base, kind="accelerate", hf_dir=hf_dir, evict=evict,
                                 prompts=args.accelerate_prompts,
                                 output_tokens=args.accelerate_output_tokens
                                 or args.output_tokens)
    if not args.skip_memory:
        systems["memory"] = dict(base, kind="kvforge", policy="memory", prompts=args.prompts)
    rounds: list[dict[str, dict]] = []
    if not args.grid_only:
        for r in range(args.rounds):
            results = {}
            for name, cfg in systems.items():
                try:
                    results[name] = run_child(cfg)
                except RuntimeError as e:
                    if name != "lp fp32":
                        raise
                    # fp32 rows may need more than a budget sized for the blocks: say so
                    print(f"{name}: {str(e).splitlines()[-1]}", flush=True)
            rounds.append(results)
            print(f"round {r + 1}: " + ", ".join(f"{n} {x['tok_s']:.1f}"
                                                 for n, x in rounds[-1].items()) + " tok/s",
                  flush=True)
        _report(rounds, overhead, budget_bytes, args)
    if args.grid or args.grid_only:
        _grid(base, args, rounds[0]["lp"] if rounds else None)
    return 0


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """"yes" when every sequence equals the in-memory run's, else "equal/total" (GGUF blocks
    round differently where a chunk's row count crosses the many-row crossover:
    docs/gguf_native.md)."""
    equal = sum(a == b for a, b in zip(tokens, reference))
    return "yes" if equal == len(tokens) else f"{equal}/{len(tokens)}"


def _median_round(runs: list[dict]) -> dict:
    """The run with the median tok/s (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    return ordered[(len(ordered) - 1) // 2]


def _median_ratio(rounds: list[dict[str, dict]], a: str, b: str) -> float:
    return statistics.median(r[a]["tok_s"] / r[b]["tok_s"] for r in rounds)


def _report(rounds: list[dict[str, dict]], overhead: int, budget: int, args) -> None:
    names = [n for n in rounds[0] if all(n in r for r in rounds)]
    results = {name: _median_round([r[name] for r in rounds]) for name in names}
    mem = results.get("memory")
    rows = []
    for name, r in results.items():
        same = "-"
        if mem is not None and "tokens" in r and name != "memory" \
                and r.get("quantization") == mem.get("quantization"):
            same = _agreement(r["tokens"], mem["tokens"])
        rows.append([name, f"{r['tok_s']:.2f}", f"{r['decode_tok_s']:.2f}" if "decode_tok_s" in r else "-",
                     f"{r['peak_rss'] / 2**20:.0f}",
                     f"{(r['peak_rss'] - overhead) / 2**20:.0f}",
                     f"{(r['peak_rss'] - r['start_rss']) / 2**20:.0f}" if "start_rss" in r else "-",
                     f"{r.get('read_per_token', r['proc_read_per_token']) / 2**20:.2f}",
                     f"{r['overlap']:.2f}" if "overlap" in r else "-",
                     f"{r['predicted_decode_tok_s']:.1f}" if "predicted_decode_tok_s" in r else "-",
                     same])
    print(format_table(["system", "tok/s", "decode tok/s", "peak RSS MiB",
                        "RSS - runtime MiB", "RSS - started engine MiB", "read MiB/token", "overlap", "LP predicted",
                        "greedy = memory"], rows))
    print(f"runtime overhead (interpreter + torch + kvforge + tokenizer + kernels, no weights): "
          f"{overhead / 2**20:.0f} MiB")
    for name, r in results.items():
        if "placement" in r:
            print(f"{name}: {r['placement']}; disk {r['disk_read_mb_s']:.0f} MB/s")
        if "device_map" in r:
            print(f"{name}: device_map modules per device {r['device_map']}; "
                  f"{r['disk_weight_bytes'] / 2**20:.0f} MiB of weights offloaded to disk; "
                  f"{r['read_per_forward'] / 2**20:.0f} MiB read from storage per forward "
                  f"({r['forwards']} forwards)")
    lp = results["lp"]
    for name in results:
        if name != "lp":
            print(f"lp / {name} by round: " + ", ".join(
                f"{r['lp']['tok_s'] / r[name]['tok_s']:.2f}" for r in rounds))
    parts = [f"lp {lp['tok_s']:.1f} tok/s = {_median_ratio(rounds, 'lp', 'naive'):.1f}x naive"]
    if "lp fp32" in results:
        parts.append(f"{_median_ratio(rounds, 'lp', 'lp fp32'):.1f}x lp on fp32 rows")
    if "accelerate (disk)" in results:
        parts.append(f"{_median_ratio(rounds, 'lp', 'accelerate (disk)'):.1f}x Accelerate "
                     f"(disk), {_median_ratio(rounds, 'lp', 'accelerate (page cache)'):.1f}x "
                     f"Accelerate (page cache)")
    if mem is not None:
        parts.append(f"{_median_ratio(rounds, 'lp', 'memory'):.2f}x in-memory")
    parts.append(f"peak RSS {lp['peak_rss'] / 2**20:.0f} MiB = started engine "
                 f"{lp['start_rss'] / 2**20:.0f} MiB (runtime {overhead / 2**20:.0f} MiB + "
                 f"skeleton, scheduler) + {(lp['peak_rss'] - lp['start_rss']) / 2**20:.0f} MiB "
                 f"for a {budget / 2**20:.0f} MiB budget")
    parts.append(f"LP predicted decode {lp['predicted_decode_tok_s']:.1f} for the steps run "
                 f"({lp['predicted_block_tok_s']:.1f} for a full block) vs measured "
                 f"{lp['decode_tok_s']:.1f} tok/s")
    parts.append(f"overlap {lp['overlap']:.2f}")
    if mem is not None:
        agree = [_agreement(r[n]["tokens"], r["memory"]["tokens"])
                 for r in rounds for n in ("lp", "naive")]
        same = "yes" if all(a == "yes" for a in agree) else "sequences equal " + ", ".join(agree)
        parts.append(f"greedy identical to in-memory: {same}")
    print(f"SUMMARY offload ({hardware_line()}, {len(rounds)} rounds, medians): "
          + "; ".join(parts))


def _grid(base: dict, args, lp: dict | None) -> None:
    """Decode tok/s over block sizes x placements, each with prompts to fill its block."""
    points = []
    for nb in (2, 4, 8, 16):
        for policy in ("w=0,kv=0", "w=10,kv=0", "w=0,kv=20"):
            points.append((nb, policy))
    lp_run = run_child(dict(base, kind="kvforge", policy="lp", prompts=args.prompts,
                            output_tokens=args.grid_output_tokens))
    rows, best = [], None
    for nb, policy in points:
        try:
            r = run_child(dict(base, kind="kvforge", policy=policy, block_batches=nb,
                               prompts=nb * args.batch_size,
                               output_tokens=args.grid_output_tokens))
        except RuntimeError as e:
            rows.append([nb, policy, "does not fit", "-", "-"])
            print(f"grid {nb}/{policy}: {str(e).splitlines()[-1][:160]}", file=sys.stderr)
            continue
        rows.append([nb, policy, f"{r['decode_tok_s']:.2f}", f"{r['predicted_decode_tok_s']:.1f}",
                     f"{r['peak_rss'] / 2**20:.0f}"])
        if best is None or r["decode_tok_s"] > best[2]:
            best = (nb, policy, r["decode_tok_s"])
    rows.append([lp_run["block_batches"], f"lp {lp_run['counts']}",
                 f"{lp_run['decode_tok_s']:.2f}", f"{lp_run['predicted_decode_tok_s']:.1f}",
                 f"{lp_run['peak_rss'] / 2**20:.0f}"])
    print(format_table(["block batches", "placement", "decode tok/s", "predicted",
                        "peak RSS MiB"], rows))
    if best is not None:
        ratio = lp_run["decode_tok_s"] / best[2]
        print(f"SUMMARY offload grid: LP choice ({lp_run['block_batches']} batches, "
              f"counts {lp_run['counts']}) {lp_run['decode_tok_s']:.2f} decode tok/s = "
              f"{ratio:.2f} of the grid best ({best[0]} batches, {best[1]}: {best[2]:.2f})")


def _parse_bytes(value: str) -> int:
    from kvforge.config import parse_bytes
    return parse_bytes(value)


if __name__ == "__main__":
    sys.exit(main())
