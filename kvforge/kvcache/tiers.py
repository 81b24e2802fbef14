"""Slower KV tiers for swap preemption: a host pool with its own block allocator, and disk.

A preempted request's KV is moved out as a *snapshot* of its first ``num_blocks`` blocks (every
block covering its computed tokens), bytes unchanged, into one tier:

    engine KV pool (per layer [P, N, B, H, D])        P = 2 (K, V) or 1 (MLA latent)
        │ swap out: kv[l][:, table[i]] ─► tier block i           i = 0 .. num_blocks - 1
        ▼
    HostKVPool  per layer [P, host_blocks, B, H, D]   (on a GPU: CPU memory; on a CPU box a
        │                                              separate, budgeted pool)
        ▼ when the host pool has too few free blocks
    DiskKVTier  one np.memmap file per request: [layers, P, num_blocks, bytes per block-plane]

Copies go through uint8 views of the tensors, so any cache dtype (fp32, bf16, fp8) round-trips
bit for bit. Both tiers own their bookkeeping and ``check_integrity()``; the scheduler decides
(``KVSwapper`` in kvforge/sched/swap.py). Bookkeeping and bytes are separate calls so that the
bytes can move on a copy worker (kvforge/kvcache/copy_engine.py) while the scheduling thread
alone touches the bookkeeping:

    reserve (tier space, handle)  ─►  copy_out (bytes)  ...  copy_in (bytes)  ─►  release
    scheduling thread                 any thread              any thread         scheduling thread
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SwapHandle:
    """Where one request's swapped KV lives. ``host_block_ids`` for the host tier (tier block
    i = the request's block i), ``path`` for disk."""

    request_id: str
    num_tokens: int                     # computed tokens the snapshot covers
    num_blocks: int
    tier: str                           # "host" | "disk"
    host_block_ids: list[int] | None = None
    path: str | None = None
    num_bytes: int = 0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a cache tensor [P, N, B, H, D] -> [P, N, B*H*D*itemsize]."""
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1], -1)


class HostKVPool:
    """``num_blocks`` host blocks shaped like the engine's; a free list + owner map."""

    def __init__(self, cache_shapes: list[tuple[int, ...]], dtype: torch.dtype,
                 num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"host pool num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # one tensor per layer, blocks on dim 1 as in the engine's cache. Empty, not zeroed: a
        # host block is read only after a swap-out wrote it, and untouched pages cost no RSS
        # (zeros made every start with swap preemption resident for the whole mirror: +1 GB
        # on Qwen2.5-Coder-0.5B's default pool)
        self.caches = [torch.empty((s[0], num_blocks, *s[2:]), dtype=dtype) for s in cache_shapes]
        self.block_bytes = sum(c[:, :1].numel() * c.element_size() for c in self.caches)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))   # pop() gives 0 first
        self._owner: dict[int, str] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for b in ids:
            self._owner[b] = request_id
        return ids

    def free(self, request_id: str, ids: list[int]) -> None:
        for b in ids:
            if self._owner.get(b) != request_id:
                raise ValueError(f"host block {b} is not held by {request_id!r}")
            del self._owner[b]
            self._free.append(b)

    def check_integrity(self, handles: list[SwapHandle] | None = None) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is free twice"
        assert not free & set(self._owner), "a host block is both free and owned"
        assert free | set(self._owner) == set(range(self.num_blocks)), "host blocks lost"
        if handles is not None:
            held = {b: h.request_id for h in handles if h.tier == "host" for b in h.host_block_ids}
            assert held == self._owner, f"host owners {self._owner} != handles {held}"


class DiskKVTier:
    """One memory-mapped file per swapped request under ``cache_dir`` (a temp dir if None)."""

    def __init__(self, cache_dir: str | None = None) -> None:
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvforge-swap-")
            cache_dir = self._tmp.name
        os.makedirs(cache_dir, exist_ok=True)
        self.cache_dir = cache_dir
        self._paths: dict[str, str] = {}

    def path_for(self, request_id: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in request_id)
        return os.path.join(self.cache_dir, f"kv-{safe}-{len(self._paths)}-{os.getpid()}.bin")

    def create(self, request_id: str, shape: tuple[int, ...]) -> str:
        """Make the (sparse) file of one request, ``shape`` = [layers, P, n, bytes]; the bytes
        come later (``write``, possibly on another thread)."""
        path = self.path_for(request_id)
        with open(path, "wb") as f:
            f.truncate(int(np.prod(shape)))
        self._paths[request_id] = path
        return path

    @staticmethod
    def write(path: str, layers: list[torch.Tensor]) -> None:
        """``layers[l]`` = uint8 [P, n, bytes] into a file made by ``create``."""
        arr = np.memmap(path, dtype=np.uint8, mode="r+", shape=(len(layers), *layers[0].shape))
        for l, t in enumerate(layers):
            arr[l] = t.numpy()
        arr.flush()
        del arr

    @staticmethod
    def read(path: str, shape: tuple[int, ...]) -> np.memmap:
        return np.memmap(path, dtype=np.uint8, mode="r", shape=shape)

    def delete(self, request_id: str) -> None:
        path = self._paths.pop(request_id)
        os.remove(path)

    def check_integrity(self, handles: list[SwapHandle] | None = None) -> None:
        for rid, path in self._paths.items():
            assert os.path.isfile(path), f"swap file of {rid!r} is missing: {path}"
        if handles is not None:
            on_disk = {h.request_id: h.path for h in handles if h.tier == "disk"}
            assert on_disk == self._paths, f"disk files {self._paths} != handles {on_disk}"


class TieredKVStore:
    """Host first, disk when the host pool is short. Moves bytes between the engine's cache
    tensors and the tiers; holds one SwapHandle per swapped-out request."""

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int, host_num_blocks: int,
                 cache_dir: str | None = None) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.host = HostKVPool([tuple(c.shape) for c in kv_caches], kv_caches[0].dtype,
                               host_num_blocks)
        self.disk = DiskKVTier(cache_dir)
        self.handles: dict[str, SwapHandle] = {}
        self.block_bytes = sum(_as_bytes(c)[:, :1].numel() for c in kv_caches)

    def reserve(self, request_id: str, num_blocks: int, num_tokens: int,
                force_disk: bool = False) -> SwapHandle:
        """Tier space for a snapshot of ``num_blocks`` blocks (host if it has room, else disk);
        the bytes come with ``copy_out``."""
        if request_id in self.handles:
            raise ValueError(f"request {request_id!r} is already swapped out")
        host_ids = None if force_disk else self.host.allocate(request_id, num_blocks)
        if host_ids is not None:
            handle = SwapHandle(request_id, num_tokens, num_blocks, "host", host_block_ids=host_ids)
        else:
            first = _as_bytes(self.kv_caches[0])
            path = self.disk.create(request_id, (len(self.kv_caches), first.shape[0], num_blocks,
                                                 first.shape[2]))
            handle = SwapHandle(request_id, num_tokens, num_blocks, "disk", path=path)
        handle.num_bytes = num_blocks * self.block_bytes
        self.handles[request_id] = handle
        return handle

    def copy_out(self, handle: SwapHandle, block_ids: list[int]) -> None:
        """Bytes of engine blocks ``block_ids`` (the request's blocks 0..n-1) into the handle's
        tier space. Touches no bookkeeping: safe on a copy worker."""
        if len(block_ids) != handle.num_blocks:
            raise ValueError(f"{handle.request_id!r}: {len(block_ids)} blocks for a snapshot of "
                             f"{handle.num_blocks}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        if handle.tier == "host":
            dst = torch.tensor(handle.host_block_ids, dtype=torch.long)
            for cache, host in zip(self.kv_caches, self.host.caches):
                _as_bytes(host).index_copy_(1, dst, _as_bytes(cache).index_select(1, index).cpu())
        else:
            self.disk.write(handle.path, [_as_bytes(c).index_select(1, index).cpu()
                                          for c in self.kv_caches])

    def copy_in(self, handle: SwapHandle, block_ids: list[int], first_block: int = 0) -> None:
        """Bytes of tier blocks ``first_block ..`` into engine blocks ``block_ids`` (same count).
        Blocks before ``first_block`` the caller already has (prefix cache). Touches no
        bookkeeping: safe on a copy worker."""
        if first_block + len(block_ids) > handle.num_blocks:
            raise ValueError(f"swap-in of {handle.request_id!r}: blocks {first_block}+"
                             f"{len(block_ids)} past the {handle.num_blocks} swapped")
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
        if handle.tier == "host":
            src = torch.tensor(handle.host_block_ids[first_block:first_block + len(block_ids)],
                               dtype=torch.long)
            for cache, host in zip(self.kv_caches, self.host.caches):
                rows = _as_bytes(host).index_select(1, src).to(cache.device)
                _as_bytes(cache).index_copy_(1, dst, rows)
        else:
            first = _as_bytes(self.kv_caches[0])
            arr = self.disk.read(handle.path, (len(self.kv_caches), first.shape[0],
                                               handle.num_blocks, first.shape[2]))
            rows = slice(first_block, first_block + len(block_ids))
            for l, cache in enumerate(self.kv_caches):
                data = torch.from_numpy(np.array(arr[l][:, rows]))     # a writable copy
                _as_bytes(cache).index_copy_(1, dst, data.to(cache.device))
            del arr

    def release(self, request_id: str) -> SwapHandle:
        """Free a snapshot's tier space (its copies must be done)."""
        handle = self.handles.pop(request_id)
        if handle.tier == "host":
            self.host.free(request_id, handle.host_block_ids)
        else:
            self.disk.delete(request_id)
        return handle

    def swap_out(self, request_id: str, block_ids: list[int], num_tokens: int,
                 force_disk: bool = False) -> SwapHandle:
        """Synchronous ``reserve`` + ``copy_out``."""
        handle = self.reserve(request_id, len(block_ids), num_tokens, force_disk)
        self.copy_out(handle, block_ids)
        return handle

    def swap_in(self, request_id: str, block_ids: list[int], first_block: int = 0) -> SwapHandle:
        """Synchronous ``copy_in`` + ``release``."""
        self.copy_in(self.handles[request_id], block_ids, first_block)
        return self.release(request_id)

    def discard(self, request_id: str) -> None:
        """Drop a swapped request's KV (it was aborted or finished while swapped out)."""
        if request_id in self.handles:
            self.release(request_id)

    def check_integrity(self) -> None:
        handles = list(self.handles.values())
        self.host.check_integrity(handles)
        self.disk.check_integrity(handles)
