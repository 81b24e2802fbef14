"""Whether a process is still there, by pid, without importing anything heavy (the kept-alive
engines' ``kvforge ps`` runs before torch is imported)."""
from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to reap it (Linux's /proc; False
    where that cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
