"""LLMEngine: one step() you can read top to bottom.

    add_request ─► Scheduler.schedule() ─► ModelRunner.execute() ─► Scheduler.update_from_output()
                                                                     └► detokenize, stop checks,
                                                                        finish, RequestOutputs
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from kvforge.attention.window_setup import (STREAMING_MAX_MODEL_LEN, log_prefix_caching,
                                            resolve_attention_window)
from kvforge.config import EngineConfig
from kvforge.engine.threads import threads_per_rank
from kvforge.detokenizer import IncrementalDetokenizer
from kvforge.engine.decode_steps import plan_decode_steps
from kvforge.distributed.tp_runner import create_model_runner
from kvforge.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvforge.engine.request import Request
from kvforge.engine.stop_checker import StopChecker
from kvforge.kvcache.kv_manager import KVCacheManager
from kvforge.loader.source import load_model_source
from kvforge.sampling_params import SamplingParams
from kvforge.sched.config import SchedulerConfig
from kvforge.sched.scheduler import Scheduler
from kvforge.sched.swap import build_kv_swapper
from kvforge.spec.factory import build_spec_decoder
from kvforge.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _SeqState:
    """Engine-side state of one sequence: text and stop handling."""
    request: Request
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    text: str = ""
    emitted_len: int = 0


class _Group:
    """The n sequences of one user request."""

    def __init__(self, request_id: str, prompt: str | None, seqs: list[_SeqState]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.seqs = seqs

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # tensor parallel: the cores are shared out among the ranks
        torch.set_num_threads(threads_per_rank(config))
        torch.manual_seed(config.seed)
        source = load_model_source(config.model)
        self.model_config = source.config
        self.tokenizer = source.load_tokenizer()
        context = self.model_config.max_position_embeddings
        # sinks + sliding window (attention/window_setup.py); None = full attention
        window = resolve_attention_window(config, self.model_config)
        if window is not None and window.from_flags:
            context = STREAMING_MAX_MODEL_LEN     # StreamingLLM distances never exceed S + W
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context "
                             f"length {context}")
        self.max_model_len = config.max_model_len or context
        # one process, or rank 0 of a tensor-parallel group (distributed/tp_runner.py)
        self.runner = create_model_runner(config, source, self.max_model_len)
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks, config.block_size,
            enable_prefix_caching=log_prefix_caching(window, config.enable_prefix_caching),
            window=window.kv_window if window is not None else None)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_model_len=self.max_model_len, policy=config.scheduling_policy,
            block_size=config.block_size, mlfq=config.mlfq,
            prefill_ahead=config.prefill_ahead), self.kv_manager)
        # swap preemption (sched/swap.py); None = recompute
        self.scheduler.swapper = build_kv_swapper(config, self.runner, self.kv_manager)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        # a request can grow only as long as the context and the whole KV pool allow
        self.max_len_per_request = min(self.max_model_len, self.scheduler.max_tokens_in_cache)
        # speculative decoding (kvforge/spec); None when off
        self.spec = build_spec_decoder(config, self.runner, self.max_len_per_request,
                                       self.tokenizer)
        forget_block = getattr(self.runner.drafter, "forget_block", None)
        if forget_block is not None:
            # a block handed out for new contents no longer holds the draft's KV (spec/draft.py)
            if self.kv_manager.pool.on_block_reused is not None:
                raise RuntimeError("the block pool's reuse hook is taken")
            self.kv_manager.pool.on_block_reused = forget_block
        # multi-step decoding of greedy batches (engine/decode_steps.py); 1 = off
        self._max_decode_steps = (config.num_decode_steps if self.runner.supports_decode_steps
                                  else 1)
        # structured outputs (kvforge/structured): grammars over the model's vocabulary
        self.grammar_compiler = GrammarCompiler(lambda: self.tokenizer.hf_tokenizer,
                                                self.model_config.vocab_size, self.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._seq_states: dict[str, _SeqState] = {}
        self._ids = itertools.count()
        self.num_preemptions_total = 0          # read by the server's metrics
        # model steps run so far: a multi-step decode call of k steps counts k (a clock that
        # does not depend on the machine: the scheduling tests and benchmarks/sched.py use it)
        self.num_model_steps_total = 0
        logger.info("kvforge engine: %s, %d layers, KV %d blocks (%d tokens, %d bytes/token)",
                    self.model_config.architecture, self.model_config.num_hidden_layers,
                    self.runner.num_blocks, self.runner.num_blocks * config.block_size,
                    self.runner.kv_bytes_per_token)
        # the long-lived objects made so far (tokenizer vocabularies, modules, the radix tree's
        # root) leave the collector's generations: a full collection walked them all, a visible
        # share of a prefill-heavy run's time in perf (vLLM freezes after start-up for the same
        # reason). Torch's own objects are frozen already where an entry point imported it
        # (kvforge/torch_import.py), so this collection walks only kvforge's.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------ requests
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        """Validate and queue a request; bad input raises ValueError and changes nothing."""
        params = params or SamplingParams()
        request_id = self.next_request_id() if request_id is None else str(request_id)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            prompt_text = None
            token_ids = list(prompt)
        self._validate_prompt(token_ids, params)
        prediction = self._prediction_ids(params)
        if params.max_tokens is None:
            params = _with_max_tokens(params, self.max_model_len - len(token_ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        # a bad schema or grammar raises ValueError here, before anything is queued
        matchers = ([self.grammar_compiler.matcher(params.structured_output)
                     for _ in range(params.n)] if params.structured_output is not None
                    else [None] * params.n)
        seqs = []
        for i in range(params.n):
            rid = request_id if i == 0 else f"{request_id}-{i}"
            req = Request(rid, token_ids, params, arrival_time=arrival, priority=priority,
                          eos_token_ids=self.eos_token_ids, parent_id=None if i == 0 else request_id,
                          sample_index=i)
            req.grammar_matcher = matchers[i]
            req.prediction_token_ids = prediction
            seqs.append(_SeqState(req, IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens),
                StopChecker(params, self.eos_token_ids, self.max_len_per_request)))
        seqs[0].request.pending_forks = [s.request for s in seqs[1:]]
        self.scheduler.add_request(seqs[0].request)   # may still refuse: register after
        self._groups[request_id] = _Group(request_id, prompt_text, seqs)
        for s in seqs:
            self._seq_states[s.request.request_id] = s
        return request_id

    def _prediction_ids(self, params: SamplingParams) -> list[int]:
        """The predicted output as token ids (text tokenized without special tokens)."""
        if params.prediction is None:
            return []
        if isinstance(params.prediction, str):
            return self.tokenizer.encode(params.prediction, add_special_tokens=False)
        self._check_in_vocabulary(params.prediction, "prediction")
        return list(params.prediction)

    def _check_in_vocabulary(self, token_ids, what: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} token id {bad[0]!r} is outside the vocabulary [0, {vocab})")

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        self._check_in_vocabulary(token_ids, "prompt")
        self._check_in_vocabulary(params.logit_bias or (), "logit_bias")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, which does not leave room for "
                             f"one output token in the context of {self.max_model_len} tokens")
        if len(token_ids) >= self.max_len_per_request:
            raise ValueError(f"prompt has {len(token_ids)} tokens but the KV pool holds only "
                             f"{self.max_len_per_request} tokens for one request")

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for s in group.seqs:
            if not s.request.is_finished:
                self.scheduler.abort_request(s.request.request_id)
            self._seq_states.pop(s.request.request_id, None)

    def interrupt_decode_steps(self) -> None:
        """End the multi-step decode call in flight after its current step (any thread; a
        no-op when none runs until the next ``clear_decode_interrupt``): the server calls it
        when a request arrives or leaves, so the next scheduling decision comes one step
        later at most instead of k (engine/decode_steps.py)."""
        self.runner.decode_interrupt.fill_(1)

    def clear_decode_interrupt(self) -> None:
        """Let the next multi-step decode calls run their k steps again (the engine thread,
        before it takes the commands that interrupted: one arriving after this interrupts
        the next call)."""
        self.runner.decode_interrupt.zero_()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess. Returns outputs of the groups that changed this step."""
        started = time.perf_counter()
        if self.spec is not None:
            self.spec.before_schedule(self.scheduler.running)
        # a step in which nobody speculates (paused: it would not pay) may decode several
        # tokens per call like an engine without speculation
        if self._max_decode_steps > 1 and not any(r.spec_token_ids for r in self.scheduler.running):
            plan_decode_steps(self.scheduler.running, self.scheduler.decode_steps_allowed(),
                              self._max_decode_steps, self.max_len_per_request, self.runner.model)
        sched = self.scheduler.schedule()
        runner_out = self.runner.execute(sched)
        self.num_preemptions_total += len(sched.preempted_request_ids)
        self.num_model_steps_total += _model_steps_run(sched, runner_out.sampled)
        self.scheduler.update_from_output(sched, runner_out.sampled)
        if self.spec is not None:
            self.spec.record(sched, runner_out.sampled)
            self.spec.observe_step(sched, runner_out.sampled, time.perf_counter() - started)

        now = time.monotonic()
        changed: dict[str, _Group] = {}
        for rid, plp in runner_out.prompt_logprobs.items():
            self._seq_states[rid].request.prompt_logprobs.extend(plp)
        for rid, tokens in runner_out.sampled.items():
            state = self._seq_states.get(rid)
            if state is None:
                continue
            req = state.request
            if req.first_token_time is None:
                req.first_token_time = now
            if rid in runner_out.logprobs:
                req.output_logprobs.append(runner_out.logprobs[rid])
            for j, token in enumerate(tokens):
                if req.grammar_matcher is not None:
                    req.grammar_matcher.consume(token)
                state.text += state.detokenizer.step([token])
                # several tokens per step (speculation): check each as if it were the last
                behind = len(tokens) - 1 - j
                result = state.stop_checker.check(req, token, state.text, behind)
                if result.status is not None:
                    if behind:
                        req.truncate_output(req.num_output_tokens - behind)
                    if result.text is not None:
                        state.text = result.text
                    else:
                        # bytes held back as a possibly incomplete character are final now
                        state.text += state.detokenizer.flush()
                    req.stop_reason = result.stop_reason
                    self.scheduler.finish_request(rid, result.status)
                    req.finished_time = now
                    break
            changed[req.parent_id or rid] = self._groups[req.parent_id or rid]
        outputs = [self._make_output(g) for g in changed.values()]
        for g in changed.values():
            if g.finished:
                del self._groups[g.request_id]
                for s in g.seqs:
                    self._seq_states.pop(s.request.request_id, None)
        return outputs

    def _make_output(self, group: _Group) -> RequestOutput:
        outs, deltas = [], []
        for s in group.seqs:
            req = s.request
            finished = req.is_finished
            safe = len(s.text) if finished else s.stop_checker.safe_text_len(s.text)
            deltas.append(s.text[s.emitted_len:safe])
            s.emitted_len = max(s.emitted_len, safe)
            outs.append(CompletionOutput(
                index=req.sample_index, text=s.text if finished else s.text[:safe],
                token_ids=list(req.output_token_ids), finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None))
        first = group.seqs[0].request
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=first.prompt_token_ids, outputs=outs, finished=group.finished,
            prompt_logprobs=(list(first.prompt_logprobs)
                             if first.sampling_params.prompt_logprobs is not None else None),
            metrics=RequestMetrics(first.arrival_time, first.first_scheduled_time,
                                   first.first_token_time, first.finished_time,
                                   sum(s.request.num_preemptions for s in group.seqs),
                                   sum(s.request.num_swaps for s in group.seqs),
                                   sum(s.request.swapped_bytes for s in group.seqs)),
            deltas=deltas)

    def shutdown(self) -> None:
        """Stop what runs outside this process (tensor-parallel workers); idempotent."""
        self.runner.shutdown()

    # --------------------------------------------------------------- debug
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        drafter = self.runner.drafter
        if drafter is not None and hasattr(drafter, "check_integrity"):
            drafter.check_integrity(self.runner.num_blocks)
        check_runner = getattr(self.runner, "check_integrity", None)
        if check_runner is not None:          # an offloaded runner's disk KV slots
            check_runner()

    @property
    def num_free_blocks(self) -> int:
        """Free KV capacity in blocks: truly free plus cached-but-unused (evictable) blocks."""
        return self.kv_manager.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks that running or swapped requests reference (0 when idle; the
        prefix cache's own blocks are in ``prefix_cache_stats``)."""
        return self.kv_manager.usage

    @property
    def prefix_cache_stats(self):
        """PrefixCacheStats (queries, query/hit tokens, hit_rate, evicted/cached blocks) or
        None with --no-enable-prefix-caching."""
        return self.kv_manager.prefix_cache_stats

    @property
    def swap_stats(self):
        """SwapStats (swap-outs/ins, prefetches, copy / exposed / overlapped seconds) or None
        with preemption_mode recompute."""
        swapper = self.scheduler.swapper
        return swapper.stats if swapper is not None else None

    @property
    def spec_stats(self):
        """SpecStats (proposed, accepted, acceptance_rate, mean_accepted_length) or None when
        speculative decoding is off."""
        return self.spec.stats if self.spec is not None else None

    @property
    def model(self):
        return self.runner.model


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(params, max_tokens=max(1, max_tokens))


def _model_steps_run(sched, sampled: dict[str, list[int]]) -> int:
    """Model steps a step took: 1, or the tokens a multi-step decode call returned per row
    (its k planned steps, fewer when interrupted)."""
    if not sched.num_lookahead_tokens or sched.spec_token_ids:
        return 1
    return max(1, max((len(tokens) for tokens in sampled.values()), default=1))
