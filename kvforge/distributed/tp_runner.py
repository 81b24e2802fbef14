"""Rank 0 of a tensor-parallel engine: the ``ModelRunner`` with its model sliced and every
model call mirrored on the workers.

    LLMEngine ── Scheduler, KV block tables (here only)
        └─ TensorParallelModelRunner (rank 0)        workers (ranks 1..N-1, tp_worker.py)
             execute(sched) ─ copy_blocks ─────────► same copies in their caches
                            ─ model(ids, pos, meta) ► same forward on their slices
                               (all-reduces in each layer, all ranks together)
                            ─ compute_logits(rows) ─► rows broadcast, logits all-gathered
                            sampling, outputs: rank 0 only
"""
from __future__ import annotations

import logging
import os
import time
import uuid
import weakref

import torch

from kvforge.config import EngineConfig
from kvforge.distributed.comm import CommGroup, open_store
from kvforge.distributed import shm_allreduce
from kvforge.distributed.executor import WorkerDiedError, create_executor
from kvforge.distributed.shm_allreduce import ShmAllReduce
from kvforge.distributed.tp_model import (load_tensor_parallel_model, rank_plan,
                                          tensor_parallel_quantization)
from kvforge.distributed.tp_plan import check_tensor_parallel_model
from kvforge.distributed.tp_worker import WorkerSpec, error_key, joined_key
from kvforge.engine.threads import threads_per_rank
from kvforge.engine.model_runner import ModelRunner
from kvforge.layers.prompt_rows import computing_prompt_rows
from kvforge.loader.source import ModelSource

logger = logging.getLogger(__name__)


def create_model_runner(config: EngineConfig, source: ModelSource,
                        max_model_len: int) -> ModelRunner:
    if config.offload_memory_budget_bytes is not None:
        from kvforge.offload.runner import OffloadModelRunner
        return OffloadModelRunner(config, source, max_model_len)
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, source, max_model_len)
    return TensorParallelModelRunner(config, source, max_model_len)


ALL_REDUCE_MODES = ("auto", "gloo", "shm")
MAX_SHM_BYTES = 64 << 20


def shared_memory_all_reduce(config: EngineConfig, backend: str) -> bool:
    """Whether all-reduces go through shared memory (``KVFORGE_TP_ALLREDUCE``: ``auto`` =
    when every rank is a local process with a core of its own, ``gloo``, ``shm``)."""
    mode = os.environ.get("KVFORGE_TP_ALLREDUCE", "auto") or "auto"
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"KVFORGE_TP_ALLREDUCE must be one of {ALL_REDUCE_MODES}, got {mode!r}")
    possible = (backend == "gloo" and config.distributed_executor_backend == "mp"
                and shm_allreduce.supported())
    if mode == "shm" and not possible:
        raise ValueError("KVFORGE_TP_ALLREDUCE=shm needs local CPU ranks (the mp executor, "
                         "x86 with /dev/shm)")
    if mode == "auto":
        # spinning ranks would take cores from each other when there are more ranks than cores
        return possible and config.tensor_parallel_size <= (os.cpu_count() or 1)
    return mode == "shm"


def _shared_choices(quantization: str, source: ModelSource) -> dict[str, str]:
    """What every rank must choose alike, chosen once here and handed to the workers as
    environment: the rows from which the model's GGUF block types leave the dot kernels and
    for which kernel, int8 panels or fp32 tiles (measured per machine and type,
    kernels/gguf_tiles.py; two ranks measuring at once could disagree, and a rank on the other
    path would round its partial sums differently from run to run)."""
    if quantization != "gguf":
        return {}
    from kvforge.kernels.gguf_tiles import shared_env
    return shared_env(t.tensor_type.name for t in source.gguf_reader().tensors)


class TensorParallelGroup:
    """Rank 0's side: the workers' executor and the collectives; every failure of a
    collective while a worker is dead becomes one ``WorkerDiedError``, raised again on every
    later call. ``all_reduce_bytes``: the largest all-reduce a step makes (tokens x hidden x
    4), the shared-memory slot size."""

    def __init__(self, config: EngineConfig, all_reduce_bytes: int = MAX_SHM_BYTES,
                 worker_env: dict[str, str] | None = None, join_timeout: float = 600.0) -> None:
        self.world_size = n = config.tensor_parallel_size
        self.error: WorkerDiedError | None = None
        self._closed = False
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        self.executor = create_executor(config.distributed_executor_backend, n - 1)
        host = self.executor.host()
        self.store = open_store(host, n)
        shm = None
        try:
            if shared_memory_all_reduce(config, backend):
                shm = ShmAllReduce(f"kvforge-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}", 0, n,
                                   min(all_reduce_bytes, MAX_SHM_BYTES), create=True,
                                   peer_check=self._check_workers)
            self.executor.start([WorkerSpec(config, rank, n, host, self.store.port,
                                            threads_per_rank(config), backend,
                                            shm_name=shm.name if shm else "",
                                            shm_bytes=shm.max_bytes if shm else 0,
                                            driver_pid=os.getpid(), env=worker_env or {})
                                 for rank in range(1, n)])
            self._wait_joined(join_timeout)
            if shm is not None:
                shm.close()       # every rank has it mapped: the file need not outlive them
            self.comm = CommGroup(self.store, 0, n, bind_host=host, backend=backend, shm=shm)
        except BaseException:
            self._closed = True
            if shm is not None:
                shm.close()
            self.executor.stop(timeout=0.0)     # the ones started: nothing waits for them
            raise

    def _check_workers(self) -> None:
        """A shared-memory wait's liveness check: a dead worker fails the collective (as its
        closed sockets fail gloo's), which ``guard`` turns into its death report."""
        dead = self.executor.dead_workers()
        if dead:
            raise RuntimeError("tensor-parallel worker gone: " + "; ".join(dead))

    def _wait_joined(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = [joined_key(r) for r in range(1, self.world_size)]
        while not self.store.check(keys):
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel workers did not start within {timeout} s")
            time.sleep(0.05)

    def _raise_if_dead(self, cause: BaseException | None = None) -> None:
        if self.error is not None:
            raise self.error
        dead = self.executor.dead_workers()
        if not dead:
            return
        lines = []
        for line in dead:
            rank = int(line.split()[1])
            lines.append(line)
            if self.store.check([error_key(rank)]):
                lines.append(self.store.get(error_key(rank)).decode(errors="replace").strip())
        self.error = WorkerDiedError("tensor-parallel worker died: " + "; ".join(lines))
        raise self.error from cause

    def guard(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, with a collective's failure turned into the workers' death report."""
        self._raise_if_dead()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, WorkerDiedError):
                raise
            # the dead worker's exit may lag its closed sockets by a moment
            for _ in range(50):
                self._raise_if_dead(e)
                time.sleep(0.02)
            raise

    def send(self, cmd: tuple) -> None:
        self.guard(self.comm.broadcast_object, cmd)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.error is None and not self.executor.dead_workers():
            try:
                self.comm.broadcast_object(("shutdown",))
            except RuntimeError:
                timeout = 0.0
        else:
            timeout = 0.0          # the live ones wait in a collective that cannot finish
        self.executor.stop(timeout)


class _DriverModel:
    """Rank 0's slice as the ``ModelRunner`` calls it: each call is first broadcast."""

    def __init__(self, model: torch.nn.Module, group: TensorParallelGroup) -> None:
        self._model, self._group = model, group

    def __call__(self, input_ids, positions, kv_caches, meta):
        self._group.send(("forward", input_ids, positions, meta, computing_prompt_rows()))
        return self._group.guard(self._model, input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.contiguous()
        self._group.send(("logits", tuple(rows.shape)))

        def project():
            self._group.comm.broadcast(rows)
            return self._model.compute_logits(rows)
        return self._group.guard(project)

    def __getattr__(self, name):
        # multi-step decoding is the compiled single-process stack: not offered here
        if name in ("can_decode_steps", "decode_steps", "decode_stack"):
            raise AttributeError(name)
        return getattr(self._model, name)


class TensorParallelModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        n = config.tensor_parallel_size
        check_tensor_parallel_model(source.config, n)     # before any worker starts
        from kvforge.attention.window_setup import resolve_attention_window
        if resolve_attention_window(config, source.config) is not None:
            raise ValueError("tensor parallel runs full attention only: this model or these "
                             "options set an attention window")
        # what the slices run ("gguf" blocks or "none"), once for this rank's load and the
        # workers' shared choices
        self._quantization = tensor_parallel_quantization(
            config.quantization, source, config.torch_dtype, config.device)
        self.tp = TensorParallelGroup(
            config, config.max_num_batched_tokens * source.config.hidden_size * 4,
            worker_env=_shared_choices(self._quantization, source))
        try:
            super().__init__(config, source, max_model_len)
            # rank 0 holds the most KV heads (the first ranks take the uneven ones), so the
            # block count that fits its budget fits every rank's
            self.tp.send(("init_cache", self.num_blocks, self.block_size))
        except BaseException:
            self.tp.shutdown(timeout=0.0)
            raise
        self.model = _DriverModel(self.model, self.tp)
        weakref.finalize(self, self.tp.shutdown)
        logger.info("tensor parallel: %d ranks (%s), %d threads each", n,
                    config.distributed_executor_backend, threads_per_rank(config))

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        plan = rank_plan(source, self.tp.world_size, 0, self._quantization)
        return self.tp.guard(load_tensor_parallel_model, source, plan, self.tp.comm,
                             quantization=self._quantization,
                             attn_backend=self.config.attention_backend, dtype=self.dtype,
                             device=self.device)

    @property
    def supports_decode_steps(self) -> bool:
        return False

    @property
    def worker_pids(self) -> list[int]:
        return self.tp.executor.worker_pids()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.tp.send(("copy_blocks", copies))
        super()._copy_blocks(copies)

    def shutdown(self) -> None:
        self.tp.shutdown()
