"""A tensor-parallel worker (ranks 1..N-1): load its slice, then replay the driver's commands.

Rank 0 lives in the engine process and owns the scheduler and the block tables; per step it
broadcasts only the step's inputs, and every worker runs the same forward on its slice:

    ("init_cache", num_blocks, block_size)    allocate this slice's paged KV cache
    ("copy_blocks", [(src, dst), ...])        copy-on-write blocks, before the forward
    ("forward", input_ids, positions, meta, as_prompt_rows)
                                              the step's forward (collectives inside), as
                                              prompt rows or not (layers/prompt_rows.py)
    ("logits", shape)                         then a tensor broadcast of the hidden rows to
                                              project: the LM head's all-gather
    ("shutdown",)
"""
from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from dataclasses import dataclass

import torch

from kvforge.config import EngineConfig
from kvforge.distributed.comm import CommGroup, connect_store
from kvforge.distributed.shm_allreduce import ShmAllReduce
from kvforge.kernels.huge_pages import kv_pool_zeros
from kvforge.layers.prompt_rows import prompt_rows


@dataclass
class WorkerSpec:
    config: EngineConfig
    rank: int
    world_size: int
    store_host: str          # rank 0's rendezvous store
    store_port: int
    num_threads: int
    backend: str = "gloo"
    bind_host: str = ""      # this worker's address for the collectives' sockets (executor)
    shm_name: str = ""       # the shared-memory all-reduce's file ("" = gloo only)
    shm_bytes: int = 0
    driver_pid: int = 0      # rank 0's process, watched while waiting in shared memory
    env: dict = dataclasses.field(default_factory=dict)   # set before anything loads


def error_key(rank: int) -> str:
    return f"kvforge/worker_error/{rank}"


def joined_key(rank: int) -> str:
    return f"kvforge/worker_joined/{rank}"


def run_worker(spec: WorkerSpec) -> None:
    """The worker's whole life; a failure is written to the store (for the driver's error
    message) before the process exits."""
    os.environ.update(spec.env)
    torch.set_num_threads(spec.num_threads)
    if spec.backend == "nccl":             # one GPU per rank on a node
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    store = connect_store(spec.store_host, spec.store_port, spec.world_size)
    try:
        # opened before joining: rank 0 unlinks the file once every rank has joined
        shm = ShmAllReduce(spec.shm_name, spec.rank, spec.world_size, spec.shm_bytes,
                           create=False, peer_check=lambda: _check_alive(spec.driver_pid)) \
            if spec.shm_name else None
        store.set(joined_key(spec.rank), str(os.getpid()))
        comm = CommGroup(store, spec.rank, spec.world_size, bind_host=spec.bind_host,
                         backend=spec.backend, shm=shm)
        _serve(spec, comm)
    except BaseException:
        store.set(error_key(spec.rank), traceback.format_exc()[-4000:])
        raise


@torch.inference_mode()
def _serve(spec: WorkerSpec, comm: CommGroup) -> None:
    from kvforge.distributed.tp_model import (load_tensor_parallel_model, rank_plan,
                                              tensor_parallel_quantization)
    from kvforge.loader.source import load_model_source
    config = spec.config
    source = load_model_source(config.model)
    quantization = tensor_parallel_quantization(config.quantization, source, config.torch_dtype,
                                                comm.device)
    plan = rank_plan(source, spec.world_size, spec.rank, quantization)
    model = load_tensor_parallel_model(source, plan, comm, quantization=quantization,
                                       attn_backend=config.attention_backend,
                                       dtype=config.torch_dtype, device=comm.device)
    kv_caches: list[torch.Tensor] = []
    hidden = None
    while True:
        cmd = comm.broadcast_object()
        kind = cmd[0]
        if kind == "forward":
            _, ids, positions, meta, as_prompt = cmd
            with prompt_rows(as_prompt):
                hidden = model(ids.to(comm.device), positions.to(comm.device), kv_caches,
                               _on_device(meta, comm.device))
        elif kind == "logits":
            rows = comm.broadcast(torch.empty(cmd[1], dtype=hidden.dtype, device=comm.device))
            model.compute_logits(rows)
        elif kind == "copy_blocks":
            src = torch.tensor([s for s, _ in cmd[1]], device=comm.device)
            dst = torch.tensor([d for _, d in cmd[1]], device=comm.device)
            for cache in kv_caches:
                cache[:, dst] = cache[:, src]
        elif kind == "init_cache":
            _, num_blocks, block_size = cmd
            # as rank 0's pool (engine/model_runner.py): pages fault in as blocks are written
            # (populating this rank's whole pool took ~3 s of the first request on a VM)
            kv_caches = kv_pool_zeros(model.kv_cache_shape(num_blocks, block_size),
                                      model.num_layers, model.kv_cache_dtype(), comm.device)
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {kind!r}")


def _check_alive(pid: int) -> None:
    from kvforge.processes import pid_exists
    if not pid_exists(pid):
        raise RuntimeError(f"tensor-parallel rank 0 (pid {pid}) is gone")


def _on_device(meta, device: torch.device):
    """The attention metadata with its tensors on this rank's device (unpickled tensors land
    on the device they left from: rank 0's)."""
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor) and value.device != device:
            setattr(meta, f.name, value.to(device))
    return meta


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker process: exit status 1 on failure (the traceback is in
    the store and on stderr)."""
    try:
        run_worker(spec)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
