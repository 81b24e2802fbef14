"""DiffusionEngine: the engine of a masked-diffusion model, with LLMEngine's request interface
(``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``), so ``LLM`` drives
either one the same way; ``engine/factory.create_engine`` picks by the model's architecture.

    add_request  tokenize, validate, queue (SamplingParams checked like any request)
    step()       no batch running: the oldest waiting request and every waiting one with the
                 same loop settings (max_tokens, steps, block, remasking, threshold, cache,
                 temperature), up to max_num_seqs, become the running batch (generator.py);
                 then one block of it is filled -> a RequestOutput per request with the text
                 of that block as its delta (finished at the first EOS / stop token / stop
                 string, or after the last block). Requests arriving meanwhile wait for the
                 batch to end; the batch ends early once every request in it has stopped.

No prefix reuse between requests: each batch refreshes its own cache (a prompt's K/V depend on
the whole canvas after it under bidirectional attention, so another request's are not exact).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from kvforge.config import EngineConfig
from kvforge.diffusion.generator import DiffusionBatch, DiffusionGenerator, DiffusionStats
from kvforge.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvforge.sampling_params import SamplingParams


@dataclass
class _Waiting:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    arrival: float


@dataclass
class _Running:
    batch: DiffusionBatch
    requests: list[_Waiting]         # one per canvas row
    emitted: list[int]               # characters of each row's text streamed so far
    finished: list[bool]             # stopped or aborted: no more outputs
    started: float
    first_block_time: float | None = None


# engine options of the autoregressive engine a diffusion model cannot honour: refused when set
# (quantization "auto" / "none" both mean the checkpoint's float weights here)
_AR_ONLY_OPTIONS = ("kv_cache_dtype", "sparse_attention", "attention_sinks", "sliding_window",
                    "speculative_method", "early_exit_threshold", "tensor_parallel_size",
                    "activation_sparsity", "offload_memory_budget", "dtype")


def _check_options(config: EngineConfig) -> None:
    from dataclasses import fields
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    bad = {name: getattr(config, name) for name in _AR_ONLY_OPTIONS
           if getattr(config, name) != defaults[name]}
    if config.quantization not in ("auto", "none"):
        bad["quantization"] = config.quantization
    if bad:
        raise ValueError(f"engine options {bad} do not apply to masked-diffusion models "
                         f"(float32 weights, whole-canvas K/V; docs/diffusion.md)")


def _loop_key(p: SamplingParams) -> tuple:
    return (p.max_tokens, p.diffusion_steps, p.diffusion_block_length, p.remasking,
            p.parallel_threshold, p.diffusion_cache, p.temperature)


class DiffusionEngine:
    def __init__(self, config: EngineConfig) -> None:
        from kvforge.engine.threads import default_num_threads
        from kvforge.loader.source import load_model_source
        from kvforge.models.diffusion_lm import load_diffusion_model
        _check_options(config)
        self.config = config
        torch.set_num_threads(config.num_threads or default_num_threads())
        torch.manual_seed(config.seed)
        source = load_model_source(config.model)
        self.model_config = source.config
        self.tokenizer = source.load_tokenizer()
        self.model = load_diffusion_model(source)
        self.generator = DiffusionGenerator(self.model)
        self.eos_token_ids = tuple(dict.fromkeys(list(self.tokenizer.eos_token_ids)
                                                 + self.model.config.eos_token_ids))
        self.max_model_len = min(config.max_model_len or self.model.config.max_position,
                                 self.model.config.max_position)
        self.stats = DiffusionStats()          # summed over every batch run
        self._waiting: dict[str, _Waiting] = {}
        self._running: _Running | None = None
        self._ids = itertools.count()

    # what the server's stats read from an engine: no paged KV pool, nothing runs between
    # steps (a step finishes its batch), no prefix cache, no grammar support
    kv_cache_usage = 0.0
    num_free_blocks = 0
    prefix_cache_stats = None
    grammar_compiler = None

    @property
    def scheduler(self):
        from types import SimpleNamespace
        run = self._running
        running = 0 if run is None else run.finished.count(False)
        return SimpleNamespace(num_running=running, num_waiting=len(self._waiting))

    def shutdown(self) -> None:
        pass

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._waiting or (self._running is not None and any(
                w.request_id == request_id for w in self._running.requests)):
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if params.n != 1:
            raise ValueError(f"diffusion models generate one output per request, got n={params.n}")
        for name in ("logprobs", "prompt_logprobs", "structured_output", "logit_bias",
                     "prediction"):
            if getattr(params, name) is not None:
                raise ValueError(f"{name} is not supported by diffusion models")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids) or self.model.config.mask_token_id in ids:
            raise ValueError(f"prompt token ids must be in [0, {vocab}) and not the mask token "
                             f"{self.model.config.mask_token_id}")
        if params.max_tokens is None:
            raise ValueError("diffusion models need max_tokens (the canvas length)")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"the model's {self.max_model_len} positions")
        from kvforge.diffusion.schedule import BlockPlan
        BlockPlan.for_request(params.max_tokens, params.diffusion_block_length,
                              params.diffusion_steps)          # refuse a bad schedule now
        self._waiting[request_id] = _Waiting(request_id, text, ids, params,
                                             time.monotonic() if arrival_time is None
                                             else arrival_time)
        return request_id

    def abort_request(self, request_id: str) -> None:
        request_id = str(request_id)
        self._waiting.pop(request_id, None)
        run = self._running
        if run is not None:
            for row, w in enumerate(run.requests):
                if w.request_id == request_id:
                    run.finished[row] = True
            if all(run.finished):
                self._running = None

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting) or self._running is not None

    # AsyncLLMEngine's interface: a diffusion step is one denoising pass, nothing to cut short
    def interrupt_decode_steps(self) -> None:
        """No multi-step decode calls here (LLMEngine's ends one early): nothing to do."""

    def clear_decode_interrupt(self) -> None:
        """See ``interrupt_decode_steps``."""

    def step(self) -> list[RequestOutput]:
        if self._running is None and not self._start_batch():
            return []
        run = self._running
        before = run.batch.stats.forwards, run.batch.stats.query_tokens, run.batch.stats.seconds
        run.batch.run_block()
        if run.first_block_time is None:
            run.first_block_time = time.monotonic()
        after = run.batch.stats
        self.stats.forwards += after.forwards - before[0]
        self.stats.query_tokens += after.query_tokens - before[1]
        self.stats.seconds += after.seconds - before[2]
        outputs = []
        for row, (w, ids) in enumerate(zip(run.requests, run.batch.tokens())):
            if not run.finished[row]:
                out = self._output(run, row, w, ids)
                run.finished[row] = out.finished
                outputs.append(out)
        if all(run.finished):
            self._running = None
        return outputs

    def _start_batch(self) -> bool:
        if not self._waiting:
            return False
        first = next(iter(self._waiting.values()))
        key = _loop_key(first.params)
        batch = [w for w in self._waiting.values()
                 if _loop_key(w.params) == key][:self.config.max_num_seqs]
        for w in batch:
            del self._waiting[w.request_id]
        generators = [None if w.params.seed is None else
                      torch.Generator().manual_seed(w.params.seed) for w in batch]
        self._running = _Running(self.generator.start([w.token_ids for w in batch],
                                                      first.params, generators),
                                 batch, [0] * len(batch), [False] * len(batch), time.monotonic())
        return True

    def _output(self, run: _Running, row: int, w: _Waiting, ids: list[int]) -> RequestOutput:
        """The request's output after the latest block: its committed tokens cut at a stop,
        the text since the last output as the delta."""
        p = w.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        reason, stop_reason = None, None
        for i, t in enumerate(ids):
            if t in stops and i >= p.min_tokens:
                reason, stop_reason, ids = "stop", t, ids[:i]
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        for s in p.stop:
            at = text.find(s)
            if at >= 0:
                reason, stop_reason = "stop", s
                text = text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                break
        if reason is None and run.batch.done:
            reason = "length"
        shown = text
        if reason is None:
            # a multi-byte character cut by the block boundary decodes as U+FFFD: hold it back
            shown = text.rstrip("\ufffd")
        delta = shown[run.emitted[row]:]
        run.emitted[row] = max(run.emitted[row], len(shown))
        now = time.monotonic()
        metrics = RequestMetrics(arrival_time=w.arrival, first_scheduled_time=run.started,
                                 first_token_time=run.first_block_time,
                                 finished_time=now if reason else None)
        return RequestOutput(w.request_id, w.prompt, w.token_ids,
                             [CompletionOutput(0, text, list(ids), reason, stop_reason)],
                             finished=reason is not None, metrics=metrics, deltas=[delta])
