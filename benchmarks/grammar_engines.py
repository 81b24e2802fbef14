"""xgrammar vs llguidance on our vocabularies: the measurement behind kvforge's choice of
llguidance (docs/structured_outputs.md).

    pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2   # xgrammar is not a
    python benchmarks/grammar_engines.py                                 # kvforge dependency
    python benchmarks/grammar_engines.py --gguf ~/.cache/kvforge/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

For one JSON schema (strings, an integer, an enum array, a nullable pattern) and the tokens of a
matching document: the tokenizer view each engine builds once, the schema's compile time (and
xgrammar's cached recompile), and the time to fill one token's bitmask at each position of the
document, over ``--repeats`` passes (mean per pass, median, p90, max over all).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hardware import hardware_line

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "email"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3},
                         "email": {"anyOf": [{"type": "string",
                                              "pattern": "^[a-z]+@[a-z]+\\.com$"},
                                             {"type": "null"}]}}}
DOCUMENT = json.dumps({"name": "Alice Smith", "age": 31, "tags": ["a", "c"],
                       "email": "alice@example.com"})


def _summary(name: str, times: list[float], n: int, setup: str) -> str:
    per_pass = [sum(times[i:i + n]) / n * 1e6 for i in range(0, len(times), n)]
    s = sorted(times)
    return (f"{name:10s} {setup} | mask us/token: mean per pass "
            f"{[round(x) for x in per_pass]}, median {statistics.median(s) * 1e6:.0f}, "
            f"p90 {s[int(len(s) * 0.9)] * 1e6:.0f}, max {s[-1] * 1e6:.0f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="default: the default model's GGUF (49k vocab)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from kvforge.loader.default_model import default_model_path
    from kvforge.loader.source import load_model_source
    from kvforge.tokenizer import Tokenizer
    path = args.gguf or default_model_path()
    hf = Tokenizer.from_gguf(path).hf_tokenizer
    vocab = load_model_source(path).config.vocab_size
    ids = hf.encode(DOCUMENT, add_special_tokens=False)
    print(f"{Path(path).name}: model vocabulary {vocab}, document {len(ids)} tokens")

    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    t1 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA))
    t3 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(args.repeats):
        matcher = xgr.GrammarMatcher(compiled)
        for tid in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(tid), tid
    print(_summary("xgrammar", times, len(ids),
                   f"tokenizer {(t1 - t0) * 1e3:.0f} ms, compile {(t2 - t1) * 1e3:.1f} ms "
                   f"(cached {(t3 - t2) * 1e3:.2f} ms)"))

    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    bitmask = llg_torch.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(args.repeats):
        matcher = llguidance.LLMatcher(lltok, grammar)
        for tid in ids:
            start = time.perf_counter()
            llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(tid), matcher.get_error()
    print(_summary("llguidance", times, len(ids),
                   f"tokenizer {(t1 - t0) * 1e3:.0f} ms, compile + matcher "
                   f"{(t2 - t1) * 1e3:.1f} ms"))
    print(hardware_line())


if __name__ == "__main__":
    main()
