"""An exclusive advisory lock on a file for the length of a ``with`` block: one process at a
time past it (a model pull, the start of a kept-alive engine). flock is released by the
kernel when its holder dies, so a killed holder never leaves the lock taken. Where there is
no flock (Windows), the block runs unguarded."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def exclusive(lock_path: str) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
