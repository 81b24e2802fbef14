"""Data-parallel replicas: N complete ``kvforge serve`` servers (engine + OpenAI API), as local
processes (``mp``) or Ray actors (``ray``, one placement-group bundle each, SPREAD over the
cluster's nodes), each reachable at its own URL for the router (dp_server.py).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from abc import ABC, abstractmethod
from typing import Any

import httpx

from kvforge.server.background import free_port, serve_in_thread

# the server options a replica takes from ``kvforge serve`` (host and port are its own)
REPLICA_SERVER_OPTIONS = ("api_key", "served_model_name", "max_waiting_requests", "max_n",
                          "shutdown_timeout", "log_level")


def _serve_replica(engine_kwargs: dict[str, Any], options: dict[str, Any]) -> None:
    """A replica process: ``kvforge serve`` with the given options."""
    from kvforge.server.serve import run
    run(engine_kwargs, argparse.Namespace(**options))


class Replicas(ABC):
    urls: list[str]

    @abstractmethod
    def dead(self) -> list[str]:
        """One line per replica that is no longer running."""

    @abstractmethod
    def stop(self, timeout: float = 30.0) -> None: ...

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Until every replica answers /health with 200; RuntimeError when one dies first."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.urls)))
        with httpx.Client(timeout=5.0) as client:
            while pending:
                dead = self.dead()
                if dead:
                    raise RuntimeError("a data-parallel replica failed to start: " + "; ".join(dead))
                for i in sorted(pending):
                    try:
                        if client.get(self.urls[i] + "/health").status_code == 200:
                            pending.discard(i)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"replicas {sorted(pending)} did not start in {timeout} s")
                time.sleep(0.2)


class ProcessReplicas(Replicas):
    def __init__(self, engine_kwargs: dict[str, Any], options: dict[str, Any], n: int) -> None:
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.processes, self.urls = [], []
        for i in range(n):
            port = free_port()
            # not daemonic: a replica with tensor parallel starts worker processes of its own
            p = ctx.Process(target=_serve_replica, name=f"kvforge-replica{i}", args=(
                engine_kwargs, {**options, "host": "127.0.0.1", "port": port}))
            p.start()
            self.processes.append(p)
            self.urls.append(f"http://127.0.0.1:{port}")

    def dead(self) -> list[str]:
        return [f"replica {i} (pid {p.pid}) exited with status {p.exitcode}"
                for i, p in enumerate(self.processes) if p.exitcode is not None]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()                   # SIGTERM: the replica's graceful shutdown
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(5)


def _ray_replica_class(ray):
    @ray.remote
    class ReplicaServer:
        def start(self, engine_kwargs: dict[str, Any], options: dict[str, Any]) -> str:
            from kvforge.server.serve import build_server
            host = ray.util.get_node_ip_address()
            port = free_port(host)
            server, self.engine = build_server(engine_kwargs, argparse.Namespace(
                **{**options, "host": host, "port": port}))
            self.server = server
            try:       # a port taken since free_port by another process: an error, not a hang
                serve_in_thread(server)
            except RuntimeError:
                self.engine.shutdown()
                raise
            return f"http://{host}:{port}"

        def pid(self) -> int:
            return os.getpid()

        def stop(self) -> None:
            self.server.should_exit = True

    return ReplicaServer


class RayReplicas(Replicas):
    def __init__(self, engine_kwargs: dict[str, Any], options: dict[str, Any], n: int,
                 cpus_per_replica: float = 1.0, ready_timeout: float = 120.0) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvforge.distributed.executor import ensure_ray
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        # a replica's own tensor-parallel workers take slots of their own
        self.ray = ray = ensure_ray(math.ceil(n * (cpus_per_replica + tp - 1)))
        self.group = placement_group([{"CPU": cpus_per_replica}] * n, strategy="SPREAD")
        if not ray.wait([self.group.ready()], timeout=ready_timeout)[0]:
            raise RuntimeError(f"the Ray cluster has no room for {n} replicas of "
                               f"{cpus_per_replica} CPU each ({ray.cluster_resources()})")
        cls = _ray_replica_class(ray)
        self.actors = [cls.options(num_cpus=cpus_per_replica, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i))).remote()
            for i in range(n)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])
        self.urls = ray.get([a.start.remote(engine_kwargs, options) for a in self.actors])

    def dead(self) -> list[str]:
        lines = []
        for i, actor in enumerate(self.actors):
            try:
                self.ray.get(actor.pid.remote(), timeout=10)
            except Exception as e:              # noqa: BLE001 - described, not handled
                lines.append(f"replica {i} (Ray actor, pid {self.pids[i]}): {type(e).__name__}")
        return lines

    def stop(self, timeout: float = 30.0) -> None:
        from ray.util.placement_group import remove_placement_group
        for actor in self.actors:
            self.ray.kill(actor)
        remove_placement_group(self.group)


def launch_replicas(backend: str, engine_kwargs: dict[str, Any], options: dict[str, Any],
                    n: int) -> Replicas:
    if backend == "mp":
        return ProcessReplicas(engine_kwargs, options, n)
    if backend == "ray":
        return RayReplicas(engine_kwargs, options, n)
    raise ValueError(f"distributed_executor_backend must be mp or ray, got {backend!r}")
