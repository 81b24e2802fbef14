"""Command line: ``kvforge generate "prompt"``, ``kvforge chat``, ``kvforge info``, ``kvforge pull``."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvforge.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, HF directory or catalogue name "
                   "(kvforge models; default: smollm2-135m-instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="torch device: cpu (default, the compiled "
                   "kernels), cuda, cuda:1, ... (PyTorch ops; README 'Other devices')")
    g.add_argument("--kv-cache-memory", default="1GiB", help="KV pool budget, e.g. 512MiB, 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes shared across requests (radix tree)")
    g.add_argument("--scheduling-policy", default="fcfs")
    g.add_argument("--mlfq-quanta", default=None, metavar="Q1,Q2,...",
                   help="mlfq: quanta of the bounded levels in tokens of work, strictly "
                        "increasing (default 8,32,128,512; an unbounded level follows)")
    g.add_argument("--mlfq-starvation-steps", type=int, default=256,
                   help="mlfq: steps a waiting request may go unscheduled before promotion")
    g.add_argument("--mlfq-prefill-weight", type=float, default=0.1,
                   help="mlfq: work of one prefill token relative to one decode step, in (0, 1] "
                        "(default 0.1: a batched prompt token costs ~0.1 of a decode step on CPU)")
    g.add_argument("--prefill-ahead", type=int, default=0, metavar="N",
                   help="with every sequence slot taken, prefill up to N waiting requests in "
                        "the step's spare budget: their first token streams at once and they "
                        "wait for a slot holding their KV (any policy; 0 = off)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"])
    g.add_argument("--swap-copy-mode", default="auto", choices=["auto", "async", "sync"],
                   help="swap copies on a worker thread / CUDA side stream (async) or inline")
    g.add_argument("--swap-prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="start swapping in the KV of the next waiting requests early (async)")
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="store paged K/V in 8 bits (4x the tokens of fp32 per byte)")
    g.add_argument("--quantization", default="auto",
                   help="weight quantization: auto (GGUF files run in their own blocks, other "
                        "models as stored), none (GGUF dequantized to fp32), int8, int4, gguf, "
                        "awq, ... (kvforge.quant)")
    g.add_argument("--quantization-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="option of the quantization method, e.g. group_size=128 (repeatable)")
    g.add_argument("--sparse-attention", default="none", choices=["none", "quest"],
                   help="quest: decode reads only the KV blocks with the top QUEST bounds")
    g.add_argument("--sparse-token-budget", type=int, default=2048,
                   help="QUEST: tokens each decode step reads (whole blocks)")
    g.add_argument("--quest-dense-layers", type=int, default=2,
                   help="QUEST: the first layers stay dense")
    g.add_argument("--attention-sinks", type=int, default=0,
                   help="StreamingLLM: the first S tokens stay visible to every query "
                        "(with --sliding-window)")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="StreamingLLM: attend to the sinks plus the last W tokens and free older "
                        "KV blocks; generation may run past the model's context")
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft", "early-exit"],
                   help="speculative decoding: n-gram prompt lookup, a draft model (self-draft "
                        "from the target's first layers unless --speculative-draft-model), or "
                        "early-exit (the first layers + a trained exit head, lossless)")
    g.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="tokens proposed per step per request")
    g.add_argument("--speculative-draft-model", default=None,
                   help="draft model: catalogue name or path (same tokenizer as the target), "
                        "e.g. qwen2.5-coder-0.5b-instruct for qwen2.5-coder-1.5b-instruct")
    g.add_argument("--speculative-draft-layers", type=int, default=None,
                   help="self-draft depth (default: a quarter of the target's layers)")
    g.add_argument("--no-speculative-draft-ngram", dest="speculative_draft_ngram",
                   action="store_false",
                   help="draft model: do not check n-gram guesses in its catch-up pass")
    g.add_argument("--speculative-draft-min-confidence", type=float, default=0.0,
                   help="draft model: stop a greedy proposal after a draft below this "
                        "probability (0 = draft all k)")
    g.add_argument("--speculative-draft-vocab", type=int, default=None, metavar="N",
                   help="draft model: its LM head over the N most frequent tokens only "
                        "(FR-Spec, lossless; default 65536 for vocabularies of 131072+, "
                        "0 = the whole head)")
    g.add_argument("--no-speculative-speed-guard", dest="speculative_speed_guard",
                   action="store_false",
                   help="speculate wherever the policy predicts a gain, even at batch sizes where "
                        "speculative steps were measured slower than decoding alone")
    g.add_argument("--num-decode-steps", type=int, default=4,
                   help="multi-step decoding: a batch of greedy decodes with nothing waiting "
                        "runs up to this many steps per engine step (tokens stream in groups "
                        "of up to this many); 1 = off")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="slice the model over N ranks, one process each (Llama family, Qwen2, "
                        "Gemma 3; float weights or a GGUF file's own blocks)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="where tensor-parallel workers and data-parallel replicas run: local "
                        "processes, or Ray actors (a local Ray, or the cluster at RAY_ADDRESS)")
    from kvforge.sparsity.commands import add_sparsity_args
    add_sparsity_args(g)
    from kvforge.exit.commands import add_early_exit_args
    add_early_exit_args(g)
    from kvforge.offload.commands import add_offload_engine_args
    add_offload_engine_args(g)


def parse_quantization_args(items: list[str] | None) -> dict[str, Any] | None:
    from kvforge.quant.commands import parse_key_values
    return parse_key_values(items)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, device=args.device,
                kv_cache_memory=args.kv_cache_memory,
                num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, enable_chunked_prefill=args.enable_chunked_prefill,
                scheduling_policy=args.scheduling_policy,
                mlfq_quanta=args.mlfq_quanta, mlfq_starvation_steps=args.mlfq_starvation_steps,
                mlfq_prefill_weight=args.mlfq_prefill_weight, prefill_ahead=args.prefill_ahead,
                preemption_mode=args.preemption_mode, swap_copy_mode=args.swap_copy_mode,
                swap_prefetch=args.swap_prefetch, num_threads=args.num_threads,
                enable_prefix_caching=args.enable_prefix_caching,
                kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                quantization_args=parse_quantization_args(args.quantization_arg),
                sparse_attention=args.sparse_attention,
                sparse_token_budget=args.sparse_token_budget,
                quest_dense_layers=args.quest_dense_layers,
                attention_sinks=args.attention_sinks, sliding_window=args.sliding_window,
                speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_draft_model=args.speculative_draft_model,
                speculative_draft_layers=args.speculative_draft_layers,
                speculative_draft_ngram=args.speculative_draft_ngram,
                speculative_draft_min_confidence=args.speculative_draft_min_confidence,
                speculative_draft_vocab=args.speculative_draft_vocab,
                speculative_speed_guard=args.speculative_speed_guard,
                num_decode_steps=args.num_decode_steps,
                early_exit_threshold=args.early_exit_threshold,
                tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend,
                activation_sparsity=args.activation_sparsity,
                activation_sparsity_mode=args.activation_sparsity_mode,
                activation_sparsity_allocation=args.activation_sparsity_allocation,
                activation_sparsity_rotation=args.activation_sparsity_rotation,
                offload_memory_budget=args.offload_memory_budget, offload_dir=args.offload_dir,
                offload_policy=args.offload_policy, offload_batch_size=args.offload_batch_size,
                offload_block_batches=args.offload_block_batches,
                offload_trace=args.offload_trace)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g = p.add_argument_group("masked-diffusion models (docs/diffusion.md)")
    g.add_argument("--diffusion-steps", type=int, default=None,
                   help="denoising steps over the max-tokens canvas (default: one token a step)")
    g.add_argument("--diffusion-block-length", type=int, default=32)
    g.add_argument("--remasking", default="low_confidence",
                   help="low_confidence | random | entropy | margin")
    g.add_argument("--parallel-threshold", type=float, default=None, metavar="TAU",
                   help="Fast-dLLM: commit every masked token above this confidence")
    g.add_argument("--diffusion-cache", default="none", help="none | prefix | dual")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
                          diffusion_steps=args.diffusion_steps,
                          diffusion_block_length=args.diffusion_block_length,
                          remasking=args.remasking, parallel_threshold=args.parallel_threshold,
                          diffusion_cache=args.diffusion_cache)


def _stream(engine, prompt, params) -> str:
    """Run one request to completion, printing text as it is produced."""
    rid = engine.add_request(None, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.deltas[0])
                sys.stdout.flush()
                text = out.outputs[0].text
    sys.stdout.write("\n")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from kvforge.config import EngineConfig
    from kvforge.engine.factory import create_engine
    engine = create_engine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    params = sampling_params(args)
    prompt = args.prompt
    # default: wrap the prompt when the model has a template (instruct models); base models
    # without one take the prompt as it is. --chat-template insists (an error without one).
    wrap = args.chat_template
    if wrap is None:
        wrap = engine.tokenizer.chat_template is not None
    if wrap:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    _stream(engine, prompt, params)
    return 0


def no_chat_template_error(model: str | None) -> str:
    return (f"kvforge chat needs a chat model; {model} has no chat template (a base model?): "
            f"use `kvforge generate --no-chat-template PROMPT`")


def chat_loop(system: str | None, reply) -> int:
    """Turns read from stdin until an empty line or its end; ``reply(messages)`` streams the
    assistant's answer to the conversation so far and returns its text (None: it failed,
    exit 2)."""
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    print("kvforge chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        answer = reply(messages)
        if answer is None:
            return 2
        messages.append({"role": "assistant", "content": answer})
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvforge.config import EngineConfig
    from kvforge.engine.factory import create_engine
    engine = create_engine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    if getattr(engine.tokenizer, "chat_template", None) is None:     # before the first prompt
        raise ValueError(no_chat_template_error(args.model))
    params = sampling_params(args)

    def reply(messages: list[dict[str, str]]) -> str:
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return _stream(engine, ids, params)

    return chat_loop(args.system, reply)


def cmd_info(args: argparse.Namespace) -> int:
    from kvforge.loader.source import load_model_source
    from kvforge.models.registry import get_model_class
    from kvforge.models.diffusion_config import DiffusionLMConfig, is_diffusion_architecture
    src = load_model_source(args.model)
    cfg = src.config
    if is_diffusion_architecture(cfg.architecture):
        d = DiffusionLMConfig.from_hf_dict(cfg.hf_config)
        print(f"model:          {src.path}")
        print(f"architecture:   {cfg.architecture} (masked diffusion, {d.layout} layout, mask "
              f"token {d.mask_token_id})")
        print(f"layers:         {d.num_layers}, hidden {d.hidden_size}, heads {d.num_heads} "
              f"(kv {d.num_kv_heads}), head_dim {d.head_dim}")
        print(f"context:        {d.max_position} tokens, vocab {d.vocab_size}")
        print(f"KV cache:       {2 * d.num_layers * d.num_kv_heads * d.head_dim * 4} bytes per "
              f"canvas position (fp32, prefix / dual cache)")
        return 0
    model = get_model_class(cfg.architecture)(cfg, device="meta")
    per_token = model.kv_cache_bytes_per_token()
    print(f"model:          {src.path}")
    print(f"architecture:   {cfg.architecture}")
    print(f"layers:         {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, "
          f"heads {cfg.num_attention_heads} (kv {cfg.num_key_value_heads}), head_dim {cfg.head_dim}")
    print(f"context:        {cfg.max_position_embeddings} tokens, vocab {cfg.vocab_size}")
    print(f"KV cache:       {per_token} bytes per token ({per_token / 1024:.1f} KiB, fp32), "
          f"{per_token * cfg.max_position_embeddings / 2**20:.1f} MiB per full context")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvforge.server.serve import run
    if args.model_pos is not None:
        args.model = args.model_pos
    return run(engine_kwargs(args), args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvforge.bench.serving import run_from_args
    run_from_args(args)
    return 0


def _add_keep_alive_arg(p: argparse.ArgumentParser) -> None:
    from kvforge.keep_alive import KEEP_ALIVE_ENV
    p.add_argument("--keep-alive", default=os.environ.get(KEEP_ALIVE_ENV), metavar="DURATION",
                   help="leave the engine loaded in the background this long after its last "
                        "request (300, 30s, 5m, 1h; negative: until `kvforge stop`); the next "
                        "generate / chat with the same engine flags uses it (default: "
                        f"${KEEP_ALIVE_ENV}, else off)")


def add_generate_and_chat_parsers(sub) -> None:
    p = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt as a user turn of the model's chat template (default: "
                        "when the model has one)")
    _add_keep_alive_arg(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="interactive multi-turn chat")
    p.add_argument("--system", default=None)
    _add_keep_alive_arg(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)


def run_kept_alive(argv: list[str]) -> int | None:
    """``kvforge generate | chat --keep-alive D``, before anything imports torch: served by a
    kept-alive engine (started when there is none); None when keep-alive is off."""
    from kvforge.keep_alive import (ensure_engine, parse_duration, sampling_fields, serve_chat,
                                    stream_generate)
    parser = argparse.ArgumentParser(prog="kvforge")
    add_generate_and_chat_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        keep_alive = parse_duration(args.keep_alive)
        if keep_alive is None:
            return None
        sock = ensure_engine(engine_kwargs(args), keep_alive)
    except (ValueError, RuntimeError) as e:
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
    import http.client
    try:
        if args.command == "chat":
            return serve_chat(sock, args.system, sampling_fields(args))
        return stream_generate(sock, args.prompt, args.chat_template, sampling_fields(args))
    except (OSError, http.client.HTTPException) as e:      # the engine went away mid-request
        print(f"\nkvforge: error: the kept-alive engine stopped answering ({e!r}); its log is "
              f"beside {sock}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["generate"], ["chat"]):
        rc = run_kept_alive(argv)
        if rc is not None:
            return rc
    if argv[:1] in (["ps"], ["stop"]):               # kept-alive engines: no torch needed
        from kvforge.keep_alive import add_commands
        parser = argparse.ArgumentParser(prog="kvforge")
        add_commands(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        try:
            return args.func(args)
        except ValueError as e:
            print(f"kvforge: error: {e}", file=sys.stderr)
            return 2
    from kvforge.torch_import import import_torch_frozen
    import_torch_frozen()            # the parser's imports load torch: load it frozen
    parser = argparse.ArgumentParser(prog="kvforge", description="kvforge LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_and_chat_parsers(sub)
    p = sub.add_parser("info", help="model facts, including KV bytes per token")
    p.add_argument("model", nargs="?", default=None)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL")
    add_engine_args(p)
    from kvforge.server.serve import add_server_args
    add_server_args(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("serve", help="serving benchmark against a running server")
    from kvforge.bench.serving import add_bench_args
    add_bench_args(p)
    p.set_defaults(func=cmd_bench_serve)
    from kvforge.keep_alive import add_commands as add_keep_alive_commands
    add_keep_alive_commands(sub)
    from kvforge.quant.commands import add_quant_commands
    add_quant_commands(sub, add_engine_args)
    from kvforge.loader.catalog_commands import add_catalog_commands
    add_catalog_commands(sub)
    from kvforge.sparsity.commands import add_calibrate_command
    add_calibrate_command(sub)
    from kvforge.offload.commands import add_offload_commands
    add_offload_commands(sub)
    from kvforge.kernels.tune_command import add_tune_command
    add_tune_command(sub)
    from kvforge.exit.commands import add_train_command
    add_train_command(sub)
    from kvforge.diffusion.commands import add_train_diffusion_command
    add_train_diffusion_command(sub)
    args = parser.parse_args(argv)
    from kvforge.loader.catalog_pull import PullError
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, PullError) as e:
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
