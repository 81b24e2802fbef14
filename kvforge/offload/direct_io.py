"""Disk-tier I/O that really reaches the disk: O_DIRECT reads into page-aligned buffers, or,
where the filesystem refuses O_DIRECT (tmpfs, some overlays), buffered reads followed by
``posix_fadvise(DONTNEED)`` so the page cache does not quietly become a second RAM tier."""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from typing import Iterator

import torch

ALIGN = 4096          # O_DIRECT wants buffer, offset and length aligned to the logical block
IOV_MAX = 1024        # buffers one preadv / pwritev takes (Linux's UIO_MAXIOV)


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class AlignedBuffer:
    """A page-aligned anonymous mapping (O_DIRECT's requirement) seen as a uint8 tensor. Pages
    are not touched until written, so an unused buffer costs no resident memory."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def open_direct(path: str, writable: bool = False) -> tuple[int, bool]:
    """(fd, direct): an O_DIRECT descriptor, or a buffered one where O_DIRECT is refused."""
    mode = os.O_RDWR if writable else os.O_RDONLY
    flags = mode | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
        if flags & getattr(os, "O_DIRECT", 0):
            probe = AlignedBuffer(ALIGN)     # some filesystems accept the flag, fail the read
            os.preadv(fd, [probe.view], 0)
            return fd, True
        return fd, False
    except OSError:
        try:
            os.close(fd)               # type: ignore[possibly-undefined]
        except (OSError, UnboundLocalError):
            pass
        return os.open(path, mode), False


def transfer(op, fd: int, views: list[memoryview], offset: int, path: str,
             direct: bool) -> None:
    """Move ``views`` (in file order) with one vectored ``os.preadv`` / ``os.pwritev`` from
    ``offset`` (in IOV_MAX pieces), resumed where a short transfer stopped; a buffered
    descriptor's pages are then dropped from the page cache."""
    total = sum(len(v) for v in views)
    pos = offset
    while views:
        n = op(fd, views[:IOV_MAX], pos)
        if n <= 0:
            raise OSError(f"short I/O on {path} at {pos}: file truncated?")
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:]] + views[1:]
    if not direct:
        os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)


class DiskFile:
    """One file of the disk tier, read into aligned buffers at aligned offsets."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd, self.direct = open_direct(path)
        self.bytes_read = 0

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` (aligned, length a multiple of ALIGN) from ``offset`` (aligned)."""
        transfer(os.preadv, self.fd, [buf], offset, self.path, self.direct)
        self.bytes_read += len(buf)

    def close(self) -> None:
        os.close(self.fd)


def write_file(path: str, chunks: list[tuple[int, bytes | memoryview]], size: int) -> None:
    """Write ``(offset, data)`` chunks into a new file of ``size`` bytes, fsync it and drop it
    from the page cache (the store is then read from the disk, not from memory)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, data in chunks:
            os.pwrite(fd, data, offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.replace(tmp, path)


PROBE_CHUNK = 16 << 20       # the calibration's read size: a streamed layer's order of size


@contextlib.contextmanager
def probe_file(directory: str, nbytes: int = 256 << 20,
               chunk: int = PROBE_CHUNK) -> Iterator[tuple[str, float]]:
    """(path, write bytes/s): a fresh file of ``nbytes`` in ``directory``, written and synced
    (the write rate) and evicted from the page cache, for the read probes; removed after."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".kvforge-bandwidth-probe")
    if chunk % ALIGN or nbytes % chunk:
        raise ValueError(f"probe chunk {chunk} must be a multiple of {ALIGN} dividing the "
                         f"probe's {nbytes} bytes")
    block = (os.urandom(1 << 20) * -(-chunk // (1 << 20)))[:chunk]   # a hole reads as no I/O
    start = time.perf_counter()
    write_file(path, [(off, block) for off in range(0, nbytes, chunk)], nbytes)
    try:
        yield path, nbytes / (time.perf_counter() - start)
    finally:
        os.unlink(path)


def measure_disk_bandwidth(directory: str, nbytes: int = 256 << 20,
                           chunk: int = PROBE_CHUNK) -> tuple[float, float]:
    """(read, write) bytes/s of the disk tier: a fresh probe file written and synced (the
    write rate), evicted, then read back directly (the read rate)."""
    with probe_file(directory, nbytes, chunk) as (path, write_rate):
        return read_rate(path, nbytes, chunk), write_rate


def read_rate(path: str, nbytes: int, chunk: int = PROBE_CHUNK) -> float:
    """Direct-read bytes/s of the first ``nbytes`` of ``path`` in ``chunk`` pieces."""
    f = DiskFile(path)
    buf = AlignedBuffer(chunk)
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, chunk):
            f.read_into(buf.view, off)
        return nbytes / (time.perf_counter() - start)
    finally:
        f.close()


def read_while(path: str, work, nbytes: int, chunk: int = PROBE_CHUNK) -> tuple[float, float]:
    """(bytes/s, seconds): the direct-read rate a thread keeps up while ``work()`` runs in the
    caller, and ``work``'s own duration then: the loader beside the layers. The first
    ``nbytes`` of ``path`` are read round and round in ``chunk`` pieces."""
    f = DiskFile(path)
    buf = AlignedBuffer(chunk)
    stop = threading.Event()
    started = threading.Event()

    def reader() -> None:
        off = 0
        started.set()
        while not stop.is_set():
            f.read_into(buf.view, off)
            off = (off + chunk) % nbytes

    thread = threading.Thread(target=reader, name="kvforge-contention-probe", daemon=True)
    try:
        thread.start()
        started.wait()
        time.sleep(0.05)                        # the reads under way before the work starts
        read0, start = f.bytes_read, time.perf_counter()
        work()
        seconds = time.perf_counter() - start
        rate = (f.bytes_read - read0) / seconds
    finally:
        stop.set()
        thread.join()
        f.close()
    return rate, seconds


def measure_block_write_s(directory: str, nbytes: int = 16 << 10, count: int = 96) -> float:
    """Seconds of one small direct write (a KV block's plane, ``nbytes``), one at a time, into
    a written file at a stride of 3 blocks (a decode batch's pattern: each sequence's current
    block, between its others). On a virtual disk it is latency, not bytes: ~110 us whatever
    the size up to tens of KiB, so a batch's write-back costs its number of writes."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".kvforge-write-probe")
    size = 3 * count * nbytes
    write_file(path, [(0, bytes(size))], size)
    fd, direct = open_direct(path, writable=True)
    buf = AlignedBuffer(nbytes)
    buf.view[:] = os.urandom(buf.nbytes)
    try:
        start = time.perf_counter()
        for i in range(count):
            os.pwritev(fd, [buf.view[:nbytes]], 3 * i * nbytes)
            if not direct:
                os.fdatasync(fd)
        return (time.perf_counter() - start) / count
    finally:
        os.close(fd)
        os.unlink(path)
