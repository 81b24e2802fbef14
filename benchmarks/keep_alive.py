"""``kvforge generate`` from the shell: a fresh process per call, against a kept-alive engine
(``--keep-alive``, kvforge/keep_alive.py), with llama.cpp's fresh process beside them.

Each row is a process started by this script and timed from its start to the first byte of
the answer on its stdout (the first token: one greedy token of a short plain prompt) and to
its exit:

- ``cold``: ``kvforge generate PROMPT --max-tokens 1`` (imports torch, loads the model);
- ``keep-alive, engine start``: the same with ``--keep-alive``, no engine running (it starts
  one in the background and asks it);
- ``keep-alive, engine running``: the next calls (``--warm-calls`` a round);
- ``llama.cpp`` (``--llama-python PY``, a Python with llama-cpp-python): a process that loads
  the file with ``Llama`` and evaluates the same prompt, the load ``gguf_vs_llamacpp.py``
  reports.

Rounds alternate the systems (``kvforge stop`` ends each round's engine); medians.

    .venv/bin/python benchmarks/keep_alive.py --rounds 3 [--llama-python ~/llamacpp-venv/bin/python]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table  # noqa: E402

PROMPT = "Write a haiku about the sea."

LLAMA_SCRIPT = """
import sys
from llama_cpp import Llama
import numpy as np
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
llm.eval(llm.tokenize(sys.argv[3].encode(), add_bos=True))
token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
sys.stdout.write(llm.detokenize([token]).decode(errors="replace") or "?")
sys.stdout.flush()
"""


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to exit) of a process running ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - start
    rest, err = proc.communicate()
    t_exit = time.perf_counter() - start
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{cmd[:3]} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return t_first, t_exit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warm-calls", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-python", default=None)
    args = p.parse_args()

    from kvforge.loader.catalog import resolve_model
    path = resolve_model(args.model)
    kvforge = [sys.executable, "-m", "kvforge.cli"]
    gen = [*kvforge, "generate", PROMPT, "--model", path, "--max-tokens", "1",
           "--no-chat-template", "--num-threads", str(args.threads)]
    env = dict(os.environ, KVFORGE_RUN_DIR=tempfile.mkdtemp(prefix="kvf"),
               OMP_NUM_THREADS=str(args.threads))
    env.pop("PYTHONDONTWRITEBYTECODE", None)        # bytecode cached, as a user's install has it
    env.pop("KVFORGE_KEEP_ALIVE", None)
    times: dict[str, list[tuple[float, float]]] = {}

    def record(name: str, cmd: list[str], run_env: dict = env) -> None:
        times.setdefault(name, []).append(timed(cmd, run_env))

    llama_env = dict(env, PYTHONPATH="")
    for r in range(args.rounds + 1):                 # round 0 warms caches, not counted
        record("cold", gen)
        if args.llama_python:
            record("llama.cpp", [args.llama_python, "-c", LLAMA_SCRIPT, path,
                                 str(args.threads), PROMPT], llama_env)
        record("keep-alive, engine start", [*gen, "--keep-alive", "10m"])
        for _ in range(args.warm_calls):
            record("keep-alive, engine running", [*gen, "--keep-alive", "10m"])
        subprocess.run([*kvforge, "stop"], env=env, capture_output=True, check=True)
        time.sleep(1.0)                              # the engine's graceful exit
        if r == 0:
            times.clear()

    rows, medians = [], {}
    for name, vals in times.items():
        first = statistics.median(v[0] for v in vals)
        medians[name] = first
        rows.append([name, len(vals), f"{first:.3f}", f"{statistics.median(v[1] for v in vals):.3f}"])
    print(f"model {os.path.basename(path)}, prompt {PROMPT!r}, 1 greedy token, {args.threads} "
          f"threads, {args.rounds} rounds")
    print(format_table(["process", "calls", "to first token (s)", "to exit (s)"], rows))
    warm, cold = medians["keep-alive, engine running"], medians["cold"]
    extra = ""
    if "llama.cpp" in medians:
        extra = f"; llama.cpp {medians['llama.cpp']:.2f} s ({medians['llama.cpp'] / warm:.1f}x the kept-alive call)"
    print(f"SUMMARY keep_alive: {os.path.basename(path)} first token cold {cold:.2f} s, "
          f"kept-alive {warm:.3f} s ({cold / warm:.1f}x sooner){extra} | {hardware_line()}")


if __name__ == "__main__":
    main()
