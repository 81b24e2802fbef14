"""CPU tensors backed by 2 MiB transparent huge pages, for the memory a decode step streams.

A batch-1 decode step reads every weight once (540 MB for SmolLM2 in fp32). With 4 KiB pages
that is ~130k TLB misses a step and every projection's stream restarts its page walks; with 2 MiB
pages the walks all but vanish, so the packed decode projections (stack + LM head) live in one
huge-page buffer in the order a step reads them. ``benchmarks/linear_kernel.py`` times the same
projections in that buffer against ordinary 4 KiB-page tensors. The price is a slower first
touch: the kernel zeroes 2 MiB at a time.

Linux hands out huge pages to a private anonymous mapping advised ``MADV_HUGEPAGE`` before its
pages are first touched when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise`` (the common default). So the buffer is a fresh ``mmap`` (zero-filled, untouched),
aligned to 2 MiB inside and advised; the tensors are views of it (``torch.frombuffer`` keeps the
mapping alive). Anywhere else (another OS, THP ``never``, another device, a small buffer, or
``KVFORGE_HUGE_PAGES=0`` in the environment) the tensors are ordinary ``torch.zeros``: same
values, same behaviour, just 4 KiB pages.
"""
from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from functools import cache

import torch

HUGE_PAGE_BYTES = 2 << 20
# every tensor of a buffer starts on a 64-byte line (the kernels' vector loads)
_ALIGN_BYTES = 64
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
    """Whether advising a mapping can get it huge pages here (THP ``always`` or ``madvise``)
    and they are wanted (``KVFORGE_HUGE_PAGES`` is not 0 / false / no / off)."""
    wanted = os.environ.get("KVFORGE_HUGE_PAGES", "1").lower() not in ("0", "false", "no", "off")
    return wanted and _thp_advisable()


@cache
def _thp_advisable() -> bool:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def huge_page_zeros(shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", populate: bool = False
                    ) -> list[torch.Tensor]:
    """Zero tensors of ``shapes``, laid out one after another (in the order given, each on a
    64-byte boundary) in one huge-page backed buffer when this machine grants huge pages, else
    ordinary ``torch.zeros``. Put tensors read in sequence in one call, in the order read.

    ``populate``: fault every page in now rather than at its first write. For the KV pool: a
    decode step that is first to write into a 2 MiB page waits for the kernel to zero it, a
    cost batch-1 decode steps would pay while the pool warms up. (``torch.zeros`` writes its
    zeros, so the fallback is populated either way.)"""
    device = torch.device(device)
    item = dtype.itemsize
    align = max(_ALIGN_BYTES // item, 1)
    numels = [math.prod(s) for s in shapes]
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    if device.type != "cpu" or total * item < HUGE_PAGE_BYTES or not huge_pages_available():
        return [torch.zeros(tuple(s), dtype=dtype, device=device) for s in shapes]
    raw = _advised_buffer(total * item)
    if populate:           # one write per small page: each huge page faults in at its first
        raw[::mmap.PAGESIZE].zero_()
    flat = raw.view(dtype)
    return [flat[o: o + n].view(tuple(s)) for o, n, s in zip(offsets, numels, shapes)]


def _advised_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh zeroed memory starting on a 2 MiB boundary, advised MADV_HUGEPAGE."""
    # private: an anonymous *shared* mapping is shmem, which has THP settings of its own
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,     # + slack for the alignment
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)   # holds the mapping alive
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    advised = (len(mapping) - skip) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, skip, advised)
    except OSError:                # refused (a sandbox, a kernel without THP): small pages
        pass
    return whole[skip: skip + nbytes]


def small_page_heads(tensors: Sequence[torch.Tensor], nbytes: int = HUGE_PAGE_BYTES) -> int:
    """Keep the first ``nbytes`` of each (untouched, huge-page advised) tensor in 4 KiB pages:
    ``MADV_NOHUGEPAGE`` over the 2 MiB-aligned range that holds them. Returns how many ranges
    were advised (0 where huge pages are off: nothing to keep them from).

    For the KV pool: the block pool hands out block 0 first, so a new engine's first request
    writes the first blocks of every K/V plane, one fresh 2 MiB page per plane (60 for SmolLM2).
    On a VM whose host backs guest memory lazily a fresh huge page costs 10-17 ms to fault (the
    host faults its 512 small pages; recycled small pages cost microseconds): 0.6 s of the first
    token there. In small pages those first blocks fault in microseconds; the rest of the pool
    stays in huge pages, which long-context decodes read ~8% faster (SmolLM2 at 4k tokens)::

        plane  [ 2 MiB-aligned range around its first nbytes: 4 KiB | huge pages ......... ]
    """
    if not tensors or not huge_pages_available():
        return 0
    import ctypes
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr() - t.data_ptr() % HUGE_PAGE_BYTES
        end = t.data_ptr() + min(nbytes, t.numel() * t.element_size())
        end = -(-end // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        if madvise(start, end - start, mmap.MADV_NOHUGEPAGE) == 0:
            advised += 1
    return advised


def kv_pool_zeros(shape: Sequence[int], num_layers: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """A KV pool of ``num_layers`` zero caches of ``shape`` (``huge_page_zeros``, layer after
    layer: attention streams it), pages faulted in as blocks are written, with the first blocks
    of every plane (``cache[0]`` / ``cache[1]`` of a two-plane cache, else the whole tensor) in
    small pages (``small_page_heads``). The engine's runner and tensor-parallel workers."""
    caches = huge_page_zeros([tuple(shape)] * num_layers, dtype, device)
    small_page_heads([plane for cache in caches
                      for plane in (cache.unbind(0) if cache.shape[0] == 2 else (cache,))])
    return caches


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of huge pages (``AnonHugePages``) in the mapping that holds ``tensor``'s first
    element, from ``/proc/self/smaps``; 0 when unknown (not Linux, not a CPU tensor)."""
    if tensor.device.type != "cpu" or not os.path.exists("/proc/self/smaps"):
        return 0
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):       # a mapping's header line
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0
