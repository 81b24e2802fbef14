"""Engine configuration: one validated dataclass; unknown keyword arguments fail early."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | str) -> int:
    """'2GiB' -> 2147483648; ints pass through."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse memory size {value!r} (use e.g. '512MiB', '2GiB')")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory size must be > 0, got {value!r}")
    return n


def _check_device(name) -> None:
    """A device string torch parses and this machine has (an error naming it otherwise, before
    any weight is read)."""
    import torch
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} is not a torch device ({e})") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"device {name!r}: no {device.type} device is available here")
    if device.index is not None and hasattr(backend, "device_count") \
            and device.index >= backend.device_count():
        raise ValueError(f"device {name!r}: this machine has {backend.device_count()} "
                         f"{device.type} device(s)")


@dataclass
class EngineConfig:
    model: str | None = None             # GGUF file or HF directory; None = default SmolLM2
    dtype: str = "float32"               # compute dtype; fp32 is the fast path on CPU
    device: str = "cpu"                  # a torch device: cpu (the tuned path), cuda, cuda:1, ...
    block_size: int = 16                 # tokens per KV block
    num_kv_blocks: int | None = None     # overrides kv_cache_memory
    kv_cache_memory: int | str = "1GiB"  # budget for the paged KV pool
    max_model_len: int | None = None     # defaults to the model's context length
    max_num_batched_tokens: int = 2048   # token budget of one step
    max_num_seqs: int = 128              # sequences in one step
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True   # radix-tree reuse of KV across shared prefixes
    scheduling_policy: str = "fcfs"
    # mlfq policy (sched/mlfq.py MLFQConfig): quanta of the bounded levels in tokens of work
    # (None = 8,32,128,512; a last unbounded level follows), steps a waiting request may starve
    # before promotion to level 0, work of a prefill token relative to a decode step
    mlfq_quanta: tuple[int, ...] | str | None = None
    mlfq_starvation_steps: int = 256
    mlfq_prefill_weight: float = 0.1
    # any policy (sched/scheduler.py step 3): with every sequence slot taken, up to this many
    # waiting requests are prefilled in the step's spare budget, send their first token and
    # wait for a slot holding their KV; 0 = off
    prefill_ahead: int = 0
    # preemption (sched/swap.py): recompute | swap | auto (cost model); swapped KV goes to a
    # host pool of swap_host_blocks blocks (None = as many as the engine pool, 0 = disk only),
    # then to memory-mapped files under swap_dir (None = a temp dir)
    preemption_mode: str = "recompute"
    swap_host_blocks: int | None = None
    swap_dir: str | None = None
    # swap copies (kvcache/copy_engine.py): async = a worker thread / CUDA side stream overlapping
    # the forward, sync = inline; auto = async on CUDA or when a core is left for the worker.
    # swap_prefetch: start the swap-in of the waiting queue's head early (async only)
    swap_copy_mode: str = "auto"
    swap_prefetch: bool = True
    attention_backend: str = "paged"
    kv_cache_dtype: str = "auto"         # auto (= dtype) | fp8_e4m3 | fp8_e5m2 (paged backend)
    # weight quantization method (kvforge.quant registry); "auto": a GGUF file runs in its own
    # blocks ("gguf") where the compiled kernels run, anything else as stored ("none")
    quantization: str = "auto"
    quantization_args: dict | None = None  # its options, e.g. {"group_size": 128}
    num_threads: int | None = None       # torch intra-op threads; None = physical cores
    sparse_attention: str = "none"       # none | quest (attention/quest.py: sparse decode)
    sparse_token_budget: int = 2048      # QUEST: tokens each decode reads (whole blocks)
    quest_dense_layers: int = 2          # QUEST: the first layers stay dense
    # StreamingLLM (attention/window.py): every query sees the first attention_sinks tokens and
    # the last sliding_window; out-of-window KV blocks are freed. None = the model's own window
    attention_sinks: int = 0
    sliding_window: int | None = None
    seed: int = 0
    # speculative decoding (kvforge/spec): None | ngram | draft (self-draft unless a draft model)
    speculative_method: str | None = None
    num_speculative_tokens: int = 4      # k proposed tokens per step per request
    speculative_draft_model: str | None = None   # draft: a smaller model, same tokenizer
    speculative_draft_layers: int | None = None  # self-draft depth; None = num_layers // 4
                                                 # (early-exit: the shallowest trained head)
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 32
    # draft model: check an n-gram guess in the draft's catch-up pass (copied spans at the cost
    # of one draft forward), and stop drafting after a greedy draft below this probability
    speculative_draft_ngram: bool = True
    speculative_draft_min_confidence: float = 0.0
    # draft model: its LM head over the N most frequent tokens only (spec/frequent_vocab.py,
    # FR-Spec, lossless); None = 65536 for vocabularies of 131072+, 0 = the whole head
    speculative_draft_vocab: int | None = None
    # time decode steps with and without speculation per batch size and pause it where it is
    # slower than decoding alone (spec/speed_guard.py); False: the policy's prediction decides
    speculative_speed_guard: bool = True
    # multi-step decoding (engine/decode_steps.py): a batch of greedy decodes, nothing waiting,
    # runs up to this many steps in one compiled call (the engine's Python once per call)
    num_decode_steps: int = 4
    # early exit (kvforge/exit, lossy): a decode token leaves at the first trained exit head
    # whose top-1 probability is >= this; None = off. Engine-wide, not per request: the heads
    # are loaded once and every decode row of a step runs the same layer loop
    early_exit_threshold: float | None = None
    # tensor parallel (kvforge/distributed): the model sliced over this many ranks, one process
    # each; workers are local processes (mp) or Ray actors (ray; RAY_ADDRESS for a cluster)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # activation sparsity (kvforge/sparsity): decode steps skip the weights of the inputs under
    # per-layer thresholds calibrated for this model-wide target (0 = off); teal: every
    # projection's input, cats: the MLP by |silu(gate)|
    activation_sparsity: float = 0.0
    activation_sparsity_mode: str = "teal"
    activation_sparsity_allocation: str = "greedy"   # teal: greedy per kind | uniform
    activation_sparsity_rotation: str = "none"       # teal: pca = inputs in principal axes
    # offloading (kvforge/offload, FlexGen): a fast-tier (RAM) budget for weights, KV and
    # activations turns it on; layers stream from offload_dir (None = ~/.cache/kvforge/offload).
    # policy: lp | naive | w=PCT (resident share); batch_size sequences per batch,
    # block_batches per block (None: the policy chooses); offload_trace: Chrome trace JSON
    offload_memory_budget: int | str | None = None
    offload_dir: str | None = None
    offload_policy: str = "lp"
    offload_batch_size: int = 8
    offload_block_batches: int | None = None
    offload_trace: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        _check_device(self.device)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        self.kv_cache_memory_bytes = parse_bytes(self.kv_cache_memory)
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        from kvforge.sched.swap import validate_swap_args
        validate_swap_args(self.preemption_mode, self.swap_host_blocks, self.swap_copy_mode)
        if not isinstance(self.swap_prefetch, bool):
            raise ValueError(f"swap_prefetch must be True or False, got {self.swap_prefetch!r}")
        from kvforge.sched.mlfq import mlfq_config_from_options
        self.mlfq = mlfq_config_from_options(self.mlfq_quanta, self.mlfq_starvation_steps,
                                             self.mlfq_prefill_weight)
        # an fp8 KV cache is an attention backend variant: swap "paged" for "paged_fp8_*"
        from kvforge.quant.fp8_kv import fp8_backend_name
        self.attention_backend = fp8_backend_name(self.attention_backend, self.kv_cache_dtype)
        # QUEST is an attention backend variant too: "paged" becomes "quest"
        from kvforge.attention.long_context import apply_sparse_attention
        apply_sparse_attention(self)
        from kvforge.attention.window_setup import validate_window_args
        validate_window_args(self)
        if self.speculative_method not in (None, "none", "ngram", "draft", "early-exit"):
            raise ValueError(f"speculative_method must be ngram, draft or early-exit, got "
                             f"{self.speculative_method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        if not 0.0 <= self.speculative_draft_min_confidence < 1.0:
            raise ValueError(f"speculative_draft_min_confidence must be in [0, 1), got "
                             f"{self.speculative_draft_min_confidence!r}")
        if self.speculative_draft_vocab is not None:
            from kvforge.spec.frequent_vocab import check_requested_size
            check_requested_size(self.speculative_draft_vocab)
        if self.speculative_draft_model and self.preemption_mode != "recompute":
            # swapping moves the target's blocks only; the draft's KV would be lost
            raise ValueError(f"a speculative draft model needs preemption_mode 'recompute', got "
                             f"{self.preemption_mode!r}")
        if not isinstance(self.num_decode_steps, int) or self.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps must be an integer >= 1, got "
                             f"{self.num_decode_steps!r}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {self.num_threads}")
        if self.quantization_args is not None and not isinstance(self.quantization_args, dict):
            raise ValueError(f"quantization_args must be a dict, got {self.quantization_args!r}")
        if self.quantization not in (None, "", "none", "auto"):
            from kvforge.quant.base import available_quantizations
            if self.quantization not in available_quantizations():
                raise ValueError(f"unknown quantization {self.quantization!r}; known: "
                                 f"{['auto', 'none'] + available_quantizations()}")

        from kvforge.distributed.config import validate_parallel_args
        validate_parallel_args(self)
        from kvforge.sparsity.config import validate_sparsity
        validate_sparsity(self.activation_sparsity, self.activation_sparsity_mode,
                          self.activation_sparsity_allocation, self.activation_sparsity_rotation)
        if self.activation_sparsity > 0 and self.tensor_parallel_size > 1:
            raise ValueError(f"activation_sparsity {self.activation_sparsity} runs in the "
                             f"single-process decode stack; tensor_parallel_size must be 1, "
                             f"got {self.tensor_parallel_size}")
        from kvforge.offload.config import validate_offload_args
        validate_offload_args(self)
        from kvforge.exit.config import validate_early_exit_args
        validate_early_exit_args(self)
        if self.activation_sparsity > 0 and self.offload_memory_budget is not None:
            raise ValueError(f"activation_sparsity {self.activation_sparsity} runs in the "
                             f"in-memory decode stack; offloaded models (offload_memory_budget "
                             f"{self.offload_memory_budget!r}) stream dense layers")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)
