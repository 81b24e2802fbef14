"""Structured outputs: per-token cost of grammar-constrained decoding, and grammar compile time.

    python benchmarks/structured.py                                  # default model (49k vocab)
    python benchmarks/structured.py --model ~/.cache/kvforge/models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python benchmarks/structured.py --batch-sizes 1 4 --max-tokens 16 --repeats 1   # quick check

Decode: b requests at once (one ``LLM.generate``), temperature 0.7, seeded, ``ignore_eos`` and a
fixed ``--max-tokens`` so the batch stays b rows to the end. "free" samples unconstrained;
"json" samples under a JSON schema too long to finish in ``--max-tokens`` (a list of records),
so the grammar is live at every step. ms/token = decode time per output token (first token to
last, prefill excluded); overhead = json / free - 1 (target <= 10%). "grammar ms/step" is the
sampler's grammar stage alone (masks filled by llguidance + applied), timed in the same run,
the part of the overhead that does not depend on how busy the machine is.

Compile: each schema's grammar checked by a fresh GrammarCompiler ("cold": JSON schema -> grammar
-> validation), then again ("cached"), plus a matcher for it; the vocabulary view the grammar
engine builds once per engine is reported on its own. Ends with one ``SUMMARY structured:`` line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                       # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import setup_threads
from benchmarks.hardware import hardware_line
from benchmarks.report import format_table

_STR = {"type": "string", "maxLength": 24}
_RECORD = {"type": "object", "additionalProperties": False,
           "required": ["id", "name", "email", "tags", "active"],
           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                          "name": _STR,
                          "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,8}\\.com$"},
                          "tags": {"type": "array", "items": {"enum": ["new", "vip", "trial"]},
                                   "maxItems": 3},
                          "active": {"type": "boolean"}}}
DECODE_SCHEMA = {"type": "array", "items": _RECORD, "minItems": 50}

COMPILE_SCHEMAS = {
    "flat": {"type": "object", "required": ["a", "b"], "additionalProperties": False,
             "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    "enum": {"enum": ["red", "green", "blue", "cyan", "magenta", "yellow"]},
    "record": _RECORD,
    "records": DECODE_SCHEMA,
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "items"],
               "properties": {"user": _RECORD, "items": {"type": "array", "maxItems": 5,
                                                         "items": {"anyOf": [_RECORD,
                                                                             {"type": "null"}]}}}},
    "refs": {"$defs": {"node": {"type": "object", "additionalProperties": False,
                                "properties": {"v": {"type": "integer"},
                                               "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                  {"type": "null"}]}}}},
             "$ref": "#/$defs/node"},
}

PROMPT = "List the customers of a small shop as JSON records (id, name, email, tags, active)."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="decode runs per cell (best kept)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


class _GrammarStageTimer:
    """Wraps the sampler's grammar stage (kvforge.layers.sampler.apply_grammars) to time it."""

    def __init__(self) -> None:
        import kvforge.layers.sampler as sampler_module
        self._module = sampler_module
        self._inner = sampler_module.apply_grammars
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self):
        def timed(logits, matchers):
            start = time.perf_counter()
            out = self._inner(logits, matchers)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out
        self._module.apply_grammars = timed
        return self

    def __exit__(self, *exc) -> None:
        self._module.apply_grammars = self._inner


def _decode(llm, prompt_ids, batch_size: int, max_tokens: int, constrained: bool):
    """-> (decode seconds per output token, grammar stage seconds per step or 0)."""
    from kvforge import SamplingParams
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, ignore_eos=True,
                             structured_output={"json": DECODE_SCHEMA} if constrained else None)
              for i in range(batch_size)]
    with _GrammarStageTimer() as timer:
        outs = llm.generate([prompt_ids] * batch_size, params, use_tqdm=False)
    decode_s = max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time
                                                               for o in outs)
    steps = max(len(o.outputs[0].token_ids) for o in outs) - 1
    return decode_s / max(steps, 1), (timer.seconds / timer.calls if timer.calls else 0.0)


def _compile_times(engine) -> tuple[float, list[list]]:
    from kvforge.structured.compiler import GrammarCompiler
    from kvforge.structured.params import StructuredOutputParams
    start = time.perf_counter()
    view = GrammarCompiler(lambda: engine.tokenizer.hf_tokenizer, engine.model_config.vocab_size,
                           engine.eos_token_ids)
    _ = view.ll_tokenizer
    view_s = time.perf_counter() - start
    rows = []
    for name, schema in COMPILE_SCHEMAS.items():
        compiler = GrammarCompiler(lambda: engine.tokenizer.hf_tokenizer,
                                   engine.model_config.vocab_size, engine.eos_token_ids)
        compiler._ll_tokenizer = view.ll_tokenizer       # the per-engine part, timed above
        params = StructuredOutputParams(json=schema)
        t0 = time.perf_counter()
        compiler.compile(params)
        t1 = time.perf_counter()
        compiler.compile(params)
        t2 = time.perf_counter()
        compiler.matcher(params)
        t3 = time.perf_counter()
        rows.append([name, round((t1 - t0) * 1e3, 2), round((t2 - t1) * 1e6, 1),
                     round((t3 - t2) * 1e3, 2)])
    return view_s, rows


def main(argv=None) -> None:
    args = parse_args(argv)
    threads = setup_threads(args.threads)
    from kvforge import LLM
    llm = LLM(args.model, num_threads=threads, kv_cache_memory="1GiB", max_model_len=2048,
              max_num_seqs=max(args.batch_sizes))
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    view_s, compile_rows = _compile_times(engine)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    _decode(llm, prompt, 1, 4, constrained=True)                    # warm-up
    rows, overheads = [], {}
    for b in args.batch_sizes:
        free = min(_decode(llm, prompt, b, args.max_tokens, False)[0]
                   for _ in range(args.repeats))
        runs = [_decode(llm, prompt, b, args.max_tokens, True) for _ in range(args.repeats)]
        json_s, stage_s = min(runs)
        overheads[b] = (json_s / free - 1, stage_s)
        rows.append([b, round(free * 1e3, 2), round(json_s * 1e3, 2),
                     f"{(json_s / free - 1):+.1%}", round(stage_s * 1e3, 3),
                     f"{stage_s / free:.1%}"])
    engine.check_integrity()
    print(f"model vocab {vocab}, {args.max_tokens} tokens per request, temperature 0.7")
    print(format_table(["batch", "free ms/token", "json ms/token", "overhead",
                        "grammar ms/step", "grammar / free step"], rows))
    print(f"vocabulary view (once per engine): {view_s * 1e3:.0f} ms")
    print(format_table(["schema", "compile ms (cold)", "compile us (cached)", "matcher ms"],
                       compile_rows))
    print(hardware_line() + f" | threads {threads}")
    cold = statistics.median(r[1] for r in compile_rows)
    cached = statistics.median(r[2] for r in compile_rows)
    parts = [f"b{b} {o:+.1%} (grammar {s * 1e3:.2f} ms/step)" for b, (o, s) in overheads.items()]
    print(f"SUMMARY structured: vocab {vocab}, per-token overhead json vs free: "
          + ", ".join(parts)
          + f"; compile median {cold:.1f} ms cold, {cached:.0f} us cached; vocabulary view "
            f"{view_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
