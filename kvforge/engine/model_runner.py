"""ModelRunner: turns a SchedulerOutput into one batched forward pass and sampled tokens.

It owns the model, the paged KV cache tensors and the sampler; it never decides what runs.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from kvforge.attention.long_context import configure_long_context
from kvforge.attention.metadata import AttentionMetadata
from kvforge.config import EngineConfig
from kvforge.engine.decode_steps import run_decode_steps
from kvforge.engine.request import Request
from kvforge.kernels.decode_stack import stack_query_limit
from kvforge.kernels.huge_pages import kv_pool_zeros
from kvforge.kernels.ops import KERNEL_KV_DTYPES
from kvforge.layers.prompt_rows import prompt_rows
from kvforge.layers.sampler import Sampler, SamplingBatch, compute_prompt_logprobs
from kvforge.loader.source import ModelSource
from kvforge.quant.gguf import integer_rows_max
from kvforge.quant.loading import load_model
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.rejection import verify_proposals

logger = logging.getLogger(__name__)
_UNSET = object()


@dataclass
class ModelRunnerOutput:
    # request_id -> token ids sampled this step (one token per step without speculation)
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> {token_id: logprob} for the sampled token and the top-N
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # request_id -> per prompt position in this chunk: {token_id: logprob} (None for position 0)
    prompt_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)


class ModelRunner:
    drafter = None      # kvforge/spec DraftProposer (draft-model speculation), set by the engine
    _stack_limit: object = _UNSET       # _stack_query_limit, resolved on first use
    _many_rows: object = _UNSET         # _many_row_kernels, resolved on first use
    # time the fp32 projections' kernel plans on first use (kernels/tune.py); False: cached
    # plans only
    times_kernels_at_start = True
    # rows the sampler takes per call (None: all of a step's at once); a runner under a memory
    # budget bounds the sampler's working copies with it
    sample_rows_per_call: int | None = None

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model_config = source.config
        self.model_path = source.path        # what trained exit heads are keyed by (kvforge/exit)
        # first row -> (requests, SamplingBatch) of the last step's sampler calls
        self._last_sampling: dict[int, tuple[list[Request], SamplingBatch]] = {}
        self.model = self._load_model(source)
        self.model.eval()
        # a separate draft model (speculative decoding) keeps its own KV tensors over the same
        # block ids, so the pool's memory budget pays for both models' bytes per block
        self.draft_model = None
        if config.speculative_method == "draft" and config.speculative_draft_model:
            from kvforge.spec.factory import load_draft_model
            self.draft_model = load_draft_model(config, source, self.device, self.dtype)
        # the decode stack's weight layout (kernels/decode_stack.py): packed for 1-4 rows per
        # step, row-major when speculation verifies up to 8
        self.model.pack_decode_weights = config.speculative_method in (None, "none")
        # QUEST budget + layer indices, attention windows (if any), on the modules that attend
        configure_long_context(self.attention_model, config)
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks(max_model_len)
        shape = self.model.kv_cache_shape(self.num_blocks, self.block_size)
        # the attention backend picks the cache dtype (fp8 KV cache: 8-bit, else the model dtype)
        cache_dtype = (self.model.kv_cache_dtype() if hasattr(self.model, "kv_cache_dtype")
                       else self.dtype)
        # one huge-page buffer, layer after layer (kernels/huge_pages.py): attention streams it.
        # Pages fault in as tokens are written, not at start: a 2 MiB page of one layer's K
        # holds hundreds of tokens, so a decode step rarely waits on a fault (~0.1 ms; 10-17 ms
        # on a VM whose host backs memory lazily), while populating the whole default 1 GiB
        # pool cost ~1-8 s of every start and its RSS. The first blocks of every plane (the
        # first requests' KV) are in small pages: a fresh huge page can take 10-17 ms to fault
        # on a VM (huge_pages.small_page_heads)
        self.kv_caches = kv_pool_zeros(shape, self.model.num_layers, cache_dtype, self.device)
        self.draft_kv_caches = None
        if self.draft_model is not None:
            draft = self.draft_model
            self.draft_kv_caches = kv_pool_zeros(
                draft.kv_cache_shape(self.num_blocks, self.block_size), draft.num_layers,
                draft.kv_cache_dtype(), self.device)
        self.sampler = Sampler()
        # set (nonzero) by any thread to end a multi-step decode call after the step in flight
        # (LLMEngine.interrupt_decode_steps; engine/decode_steps.py)
        self.decode_interrupt = torch.zeros(1, dtype=torch.int32)
        # the compiled decode stack now, with the model configured (long context, layout), so
        # packing its weights is not the first request's wait
        if hasattr(self.model, "decode_stack"):
            self.model.decode_stack()
        if self.device.type == "cpu":     # the fp32 projections' kernels, timed on this CPU
            from kvforge.kernels.tune import tune_model
            tune_model(self.model, max_rows=max(config.max_num_seqs,
                                                config.max_num_batched_tokens),
                       head_rows=config.max_num_seqs, measure=self.times_kernels_at_start)
        if config.activation_sparsity > 0:          # sparse decode projections (kvforge/sparsity)
            from kvforge.sparsity.engine import enable_activation_sparsity
            enable_activation_sparsity(self.model, source, config)
        if config.early_exit_threshold is not None:  # decodes leave at exit heads (kvforge/exit)
            from kvforge.exit.model import EarlyExitLM
            from kvforge.exit.store import load_heads_for
            self.model = EarlyExitLM(self.model, load_heads_for(self.model, self.model_path),
                                     config.early_exit_threshold)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f KiB per token",
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                    self.model.kv_cache_bytes_per_block(self.block_size) / self.block_size / 1024)

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        # builds the model class, swaps in quantized linear methods, loads (and calibrates);
        # a tensor-parallel runner loads its rank's slice instead (distributed/tp_runner.py)
        config = self.config
        return load_model(source, quantization=config.quantization,
                          quantization_args=config.quantization_args,
                          attn_backend=config.attention_backend, dtype=self.dtype,
                          device=self.device)

    def shutdown(self) -> None:
        """Release what outlives the runner (tensor-parallel workers); nothing here."""

    @property
    def supports_decode_steps(self) -> bool:
        """Whether the model has multi-step decoding (engine/decode_steps.py) over this cache
        (the compiled stack reads fp32 or fp8 paged caches)."""
        return (hasattr(self.model, "can_decode_steps")
                and self.kv_caches[0].dtype in KERNEL_KV_DTYPES)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_cache_bytes_per_token()

    def _num_kv_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.model.kv_cache_bytes_per_block(self.block_size)
        if self.draft_model is not None:
            per_block += self.draft_model.kv_cache_bytes_per_block(self.block_size)
        num_blocks = self.config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {self.config.kv_cache_memory!r} holds no KV block "
                             f"({per_block} bytes per block)")
        return int(num_blocks)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        out = ModelRunnerOutput()
        if not sched.scheduled:
            return out
        if sched.num_lookahead_tokens and self.supports_decode_steps:
            sampled = run_decode_steps(self.model, sched, self.kv_caches, self.device,
                                       self.decode_interrupt)
            if sampled is not None:
                out.sampled = sampled
                return out
        # speculative decoding: a draft model fills its lookahead slots now that they exist
        draft_probs = (self.drafter.propose(sched, self.kv_caches)
                       if self.drafter is not None else {})

        input_ids: list[int] = []
        query_lens, context_lens, block_tables, prompt_seqs = [], [], [], []
        for req in sched.scheduled:
            n = sched.num_query_tokens(req.request_id)     # lookahead slots stay unused here
            start = req.num_computed_tokens
            spec = sched.spec_token_ids.get(req.request_id, ())
            input_ids.extend(req.all_token_ids[start:start + n - len(spec)])
            input_ids.extend(spec)
            query_lens.append(n)
            context_lens.append(start)
            block_tables.append(sched.block_ids[req.request_id])
            prompt_seqs.append(start < req.num_prompt_tokens)
        hidden = self._forward(input_ids, query_lens, context_lens, block_tables, prompt_seqs)

        # Rows whose last position produces the next token: the request caught up with its
        # tokens this step. Forked children (n > 1) sample from their parent's row.
        sample_reqs: list[Request] = []
        sample_rows: list[int] = []
        spec_reqs: list[Request] = []
        spec_rows: list[int] = []
        row_of: dict[str, int] = {}
        ends = list(itertools.accumulate(query_lens))
        for i, req in enumerate(sched.scheduled):
            n = query_lens[i]
            num_spec = len(sched.spec_token_ids.get(req.request_id, ()))
            if num_spec:           # speculative decoding: 1 + k verification rows
                spec_reqs.append(req)
                spec_rows.extend(range(ends[i] - 1 - num_spec, ends[i]))
            elif context_lens[i] + n == req.num_tokens:
                row_of[req.request_id] = ends[i] - 1
                sample_reqs.append(req)
                sample_rows.append(ends[i] - 1)
            if req.sampling_params.prompt_logprobs is not None and context_lens[i] < req.num_prompt_tokens:
                out.prompt_logprobs[req.request_id] = self._prompt_logprobs(
                    req, hidden, ends[i] - n, context_lens[i], n)
        for child in sched.forked_requests:
            sample_reqs.append(child)
            sample_rows.append(row_of[sched.forked[child.request_id]])
        if spec_reqs:
            spec_logits = self.model.compute_logits(hidden[torch.tensor(spec_rows, device=self.device)])
            drafts = [sched.spec_token_ids[r.request_id] for r in spec_reqs]
            for req, tokens in zip(spec_reqs, verify_proposals(spec_logits, spec_reqs, drafts,
                                                               draft_probs)):
                out.sampled[req.request_id] = tokens
        if not sample_reqs:
            return out
        # a pure decode batch samples every row, in order: no gather
        rows = (hidden if sample_rows == list(range(hidden.shape[0]))
                else hidden[torch.tensor(sample_rows, device=self.device)])
        logits = self.model.compute_logits(rows)
        # the sampler's working copies (penalties, softmax, logprobs) are as large as the
        # logits it takes: a runner under a memory budget samples its rows a chunk at a time
        chunk = self.sample_rows_per_call or len(sample_reqs)
        for c0 in range(0, len(sample_reqs), chunk):
            reqs = sample_reqs[c0:c0 + chunk]
            batch = self._sampling_batch(reqs, logits.shape[-1], c0)
            self._take_samples(out, reqs, self.sampler(logits[c0:c0 + len(reqs)], batch))
        return out

    @staticmethod
    def _take_samples(out: ModelRunnerOutput, reqs: list[Request], result) -> None:
        tokens = result.sampled_token_ids.tolist()
        for j, req in enumerate(reqs):
            out.sampled[req.request_id] = [tokens[j]]
        if result.logprobs is not None:
            lp = result.logprobs.tolist()
            lp_ids = result.logprob_token_ids.tolist()
            for j, req in enumerate(reqs):
                k = req.sampling_params.logprobs
                if k is None:
                    continue
                out.logprobs[req.request_id] = {t: v for t, v in zip(lp_ids[j][:k + 1], lp[j][:k + 1])}

    def _forward(self, input_ids: list[int], query_lens: list[int], context_lens: list[int],
                 block_tables: list[list[int]], prompt_seqs: list[bool]) -> torch.Tensor:
        """[T, hidden] for the step's tokens. A step whose sequences take different paths
        (``_path_groups``) runs one forward per path, each over its own sequences."""
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        groups = self._path_groups(query_lens, prompt_seqs)
        if len(groups) == 1:
            _, as_prompt = groups[0]
            meta = AttentionMetadata.build(query_lens, context_lens, block_tables,
                                           self.block_size, self.device)
            with prompt_rows(as_prompt):
                return self.model(ids, meta.positions(), self.kv_caches, meta)
        starts = [0, *itertools.accumulate(query_lens)]
        hidden = None
        for seqs, as_prompt in groups:
            rows = torch.tensor([t for i in seqs for t in range(starts[i], starts[i + 1])],
                                device=self.device)
            meta = AttentionMetadata.build([query_lens[i] for i in seqs],
                                           [context_lens[i] for i in seqs],
                                           [block_tables[i] for i in seqs], self.block_size,
                                           self.device)
            with prompt_rows(as_prompt):
                part = self.model(ids[rows], meta.positions(), self.kv_caches, meta)
            if hidden is None:
                hidden = part.new_empty((len(input_ids), part.shape[-1]))
            hidden[rows] = part
        return hidden

    def _path_groups(self, query_lens: list[int],
                     prompt_seqs: list[bool]) -> list[tuple[list[int], bool]]:
        """(sequence indices, as prompt rows) per forward of the step, in order.

        Why: which path computes a row changes its low bits (the stack's and the Python layers'
        kernels round differently; GGUF projections round by their call's row count, and their
        8-bit activations turn such bits into visible differences), and greedy output must not
        depend on what else shares the step, nor on how a prompt is split. So:

            prompt rows          (a sequence prefilling its prompt: whole, a chunk, a prefix
                                 hit's tail) the Python layers, as prompt rows
                                 (``layers/prompt_rows.py``): GGUF's many-row kernel at any count
            decodes, short runs  (<= the compiled stack's query limit: speculative
                                 verification) the compiled decode stack, where the model has one
            the rest             the Python layers, as they choose by rows

        A model with neither a stack nor many-row GGUF kernels (an accelerator's) runs the step
        as one forward: there, splitting would cost a second pass over the weights for bits."""
        limit = self._stack_query_limit
        if limit is None and not self._many_row_kernels:
            return [(list(range(len(query_lens))), False)]
        stacked = [i for i, q in enumerate(query_lens)
                   if not prompt_seqs[i] and limit is not None and q <= limit]
        prompts = [i for i, p in enumerate(prompt_seqs) if p]
        rest = [i for i, q in enumerate(query_lens)
                if not prompt_seqs[i] and (limit is None or q > limit)]
        return [(seqs, as_prompt) for seqs, as_prompt in
                ((stacked, False), (prompts, True), (rest, False)) if seqs]

    @property
    def _many_row_kernels(self) -> bool:
        """Whether a projection of the model leaves its dot kernels from some row count on
        (GGUF weights on this machine's measured crossover: quant/gguf.integer_rows_max)."""
        if self._many_rows is _UNSET:
            self._many_rows = integer_rows_max(self.model) is not None
        return self._many_rows

    @property
    def attention_model(self) -> torch.nn.Module:
        """The model whose attention backends and RoPE the long-context setup configures."""
        return self.model

    @property
    def _stack_query_limit(self) -> int | None:
        """Longest query run the model's compiled decode stack takes (None: no stack)."""
        if self._stack_limit is _UNSET:
            stack = self.model.decode_stack() if hasattr(self.model, "decode_stack") else None
            self._stack_limit = (stack_query_limit(stack) if stack is not None
                                 and self.kv_caches[0].dtype in KERNEL_KV_DTYPES else None)
        return self._stack_limit

    def _sampling_batch(self, requests: list[Request], vocab_size: int,
                        first_row: int = 0) -> SamplingBatch:
        """The last step's batch for the rows from ``first_row`` again when it samples for the
        same requests and nothing in it depends on their outputs (decode steps of a steady
        batch), else a new one."""
        last = self._last_sampling.get(first_row)
        if last is not None:
            # the same Request objects (held here, so never a recycled id), in the same rows
            last_requests, batch = last
            if (batch.reusable and batch.vocab_size == vocab_size
                    and len(last_requests) == len(requests)
                    and all(a is b for a, b in zip(last_requests, requests))):
                return batch
        batch = SamplingBatch.from_requests(requests, vocab_size, self.device)
        if first_row == 0:
            self._last_sampling.clear()      # a step's chunks: 0, then the rest
        self._last_sampling[first_row] = (list(requests), batch)
        return batch

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, row0: int, start: int,
                         n: int) -> list[dict[int, float] | None]:
        """Logprob of each prompt token given the ones before it, for positions in this chunk."""
        k = req.sampling_params.prompt_logprobs
        result: list[dict[int, float] | None] = [None] if start == 0 else []
        # position p predicts token p + 1; only prompt tokens are scored
        last = min(start + n, req.num_prompt_tokens - 1)
        if last <= start:
            return result
        logits = self.model.compute_logits(hidden[row0: row0 + (last - start)])
        targets = torch.tensor(req.prompt_token_ids[start + 1: last + 1], device=self.device)
        lp, ids = compute_prompt_logprobs(logits, targets, k)
        for lp_row, id_row in zip(lp.tolist(), ids.tolist()):
            result.append({t: v for t, v in zip(id_row, lp_row)})
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            # cache: [2, num_blocks, ...]; copy-on-write of whole blocks for K and V
            cache[:, dst] = cache[:, src]
