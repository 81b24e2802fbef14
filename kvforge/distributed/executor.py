"""Where tensor-parallel workers run: local processes (``mp``) or Ray actors (``ray``).

An executor starts ranks 1..N-1 (rank 0 is the engine process), says which of them have died
and stops them. Ray places the workers in a placement group, on a local Ray instance started
for the run or on the cluster ``RAY_ADDRESS`` names (how workers reach other machines: each
binds its collectives to its node's address).
"""
from __future__ import annotations

import logging
import math
import os
import signal
from abc import ABC, abstractmethod

from kvforge.distributed.config import EXECUTOR_BACKENDS
from kvforge.distributed.tp_worker import WorkerSpec, worker_main
from kvforge.processes import pid_exists

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot run another step."""


class TensorParallelExecutor(ABC):
    @abstractmethod
    def host(self) -> str:
        """This (rank 0's) address, where the rendezvous store listens."""

    @abstractmethod
    def start(self, specs: list[WorkerSpec]) -> None: ...

    @abstractmethod
    def dead_workers(self) -> list[str]:
        """One line per worker that is no longer running (empty while all run)."""

    @abstractmethod
    def worker_pids(self) -> list[int]: ...

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Wait up to ``timeout`` for workers told to shut down, then kill what is left."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class MultiprocessingExecutor(TensorParallelExecutor):
    """Workers as spawned local processes (torch.multiprocessing, ``spawn``: a fork of a
    process with threads and an OpenMP pool is unsafe)."""

    def __init__(self) -> None:
        self.processes = []

    def host(self) -> str:
        return "127.0.0.1"

    def start(self, specs: list[WorkerSpec]) -> None:
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        for spec in specs:
            spec.bind_host = "127.0.0.1"
            p = ctx.Process(target=worker_main, args=(spec,), name=f"kvforge-tp-rank{spec.rank}",
                            daemon=True)
            p.start()
            self.processes.append((spec.rank, p))

    def dead_workers(self) -> list[str]:
        lines = []
        for rank, p in self.processes:
            if p.exitcode is not None:
                lines.append(f"rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}")
            elif not pid_exists(p.pid):      # reaped by someone else: no exit status left
                lines.append(f"rank {rank} (pid {p.pid}) is gone")
        return lines

    def worker_pids(self) -> list[int]:
        return [p.pid for _, p in self.processes]

    def stop(self, timeout: float) -> None:
        for _, p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)


def ensure_ray(min_cpus: int = 1):
    """The ``ray`` module, connected: to ``RAY_ADDRESS`` if set, else an instance started
    here (and already-initialised Ray is used as it is). A local instance declares at least
    ``min_cpus`` CPUs: Ray's CPUs are scheduling slots, not pinned cores, and the ranks share
    the cores through their thread counts."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: "
                         "pip install 'kvforge[ray]'") from None
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False,
                     object_store_memory=100 * 2**20)
    return ray


def _ray_worker_class(ray):
    @ray.remote
    class TensorParallelWorker:
        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def pid(self) -> int:
            return os.getpid()

        def run(self, spec: WorkerSpec) -> None:
            from kvforge.distributed.tp_worker import run_worker
            run_worker(spec)

    return TensorParallelWorker


class RayExecutor(TensorParallelExecutor):
    """Workers as Ray actors, one bundle of ``cpus_per_worker`` CPUs each in a placement
    group (PACK: on as few nodes as fit)."""

    def __init__(self, num_workers: int, cpus_per_worker: float = 1.0,
                 ready_timeout: float = 120.0) -> None:
        self.ray = ensure_ray(math.ceil(num_workers * cpus_per_worker))
        self.cpus_per_worker = cpus_per_worker
        self.ready_timeout = ready_timeout
        self.actors, self.runs, self._pids = [], [], []
        self.group = None

    def host(self) -> str:
        return self.ray.util.get_node_ip_address()

    def start(self, specs: list[WorkerSpec]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ray = self.ray
        self.group = placement_group([{"CPU": self.cpus_per_worker}] * len(specs), strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=self.ready_timeout)
        if not ready:
            raise RuntimeError(f"the Ray cluster has no room for {len(specs)} tensor-parallel "
                               f"workers of {self.cpus_per_worker} CPU each "
                               f"(cluster resources: {ray.cluster_resources()})")
        worker_cls = _ray_worker_class(ray)
        for i, spec in enumerate(specs):
            actor = worker_cls.options(
                num_cpus=self.cpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i)).remote()
            spec.bind_host = ray.get(actor.node_ip.remote())
            self._pids.append(ray.get(actor.pid.remote()))
            self.actors.append((spec.rank, actor))
            self.runs.append(actor.run.remote(spec))

    def dead_workers(self) -> list[str]:
        ray = self.ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        lines = []
        for (rank, _), pid, ref in zip(self.actors, self._pids, self.runs):
            if ref in done:
                try:
                    ray.get(ref)
                    why = "returned"
                except Exception as e:          # noqa: BLE001 - described, not handled
                    why = f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"
                lines.append(f"rank {rank} (Ray actor, pid {pid}) {why}")
        return lines

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def stop(self, timeout: float) -> None:
        ray = self.ray
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for _, actor in self.actors:
            ray.kill(actor)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.group)
            self.group = None


def create_executor(backend: str, num_workers: int) -> TensorParallelExecutor:
    if backend == "mp":
        return MultiprocessingExecutor()
    if backend == "ray":
        return RayExecutor(num_workers)
    raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                     f"got {backend!r}")
