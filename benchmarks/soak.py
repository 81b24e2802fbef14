"""Soak the OpenAI server: 1,000 streamed requests (16 in flight, 20% dropped mid-stream by the
client, 5% with a wrong API key) against ``kvforge serve --api-key`` on 127.0.0.1, then check
that nothing leaked (kvforge/bench/soak.py says what is checked).

    python benchmarks/soak.py                          # default model, 1,000 requests
    python benchmarks/soak.py --num-requests 200 --model tiny_hf_dir --engine-arg block_size=4

The server runs in this process (uvicorn on a thread) so that the engine's check_integrity()
can be called after the run without an endpoint for it; RSS is this process's. Prints a table
and one SUMMARY line with the hardware; exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hardware import hardware_line, physical_cores
from kvforge.bench.soak import SoakConfig, run_soak


def parse_engine_args(items: list[str]) -> dict:
    import ast
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--engine-arg {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key.strip()] = raw
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--drop-fraction", type=float, default=d.drop_fraction)
    p.add_argument("--wrong-key-fraction", type=float, default=d.wrong_key_fraction)
    p.add_argument("--max-output-tokens", type=int, default=d.max_output_tokens)
    p.add_argument("--max-rss-growth", type=float, default=d.max_rss_growth)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine option, repeatable, e.g. max_num_seqs=32")
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                     drop_fraction=args.drop_fraction, wrong_key_fraction=args.wrong_key_fraction,
                     max_output_tokens=args.max_output_tokens, max_rss_growth=args.max_rss_growth,
                     seed=args.seed)
    engine_kwargs = {"model": args.model, "num_threads": args.threads or physical_cores(),
                     **parse_engine_args(args.engine_arg)}
    from kvforge.server.background import BackgroundServer
    api_key = secrets.token_urlsafe(16)
    server = BackgroundServer(engine_kwargs, api_key=api_key, max_waiting_requests=100_000)
    try:
        report = run_soak(server, cfg, api_key)
    finally:
        server.stop()
    hardware = hardware_line()
    print(hardware)
    print(report.table())
    for failure in report.failures[:20]:
        print("FAIL:", failure)
    if len(report.failures) > 20:
        print(f"... and {len(report.failures) - 20} more failures")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(
            {"hardware": hardware, "config": asdict(cfg), "engine": engine_kwargs,
             "report": asdict(report)}, indent=1, default=str))
    print(report.summary(hardware))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
