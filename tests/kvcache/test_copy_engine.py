"""KV copy engine: sync copies run inline, async ones on one FIFO worker thread; a waiter sees
finished bytes or the copy's error; exposed vs overlapped time is accounted."""
import os
import threading
import time

import pytest
import torch

from kvforge.kvcache.copy_engine import KVCopyEngine, resolve_copy_mode


def test_modes_are_validated_and_auto_resolves():
    with pytest.raises(ValueError, match="'later'"):
        KVCopyEngine("later")
    # auto on CPU: async only when torch's threads leave a core for the worker
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = "async" if (os.cpu_count() or 1) > 1 else "sync"
        assert resolve_copy_mode("auto", torch.device("cpu")) == expected
    finally:
        torch.set_num_threads(threads)
    assert resolve_copy_mode("sync", torch.device("cpu")) == "sync"


def test_sync_copies_run_inline_and_are_all_exposed():
    engine = KVCopyEngine("sync")
    ran_on = []
    handle = engine.submit(lambda: ran_on.append(threading.current_thread()))
    assert handle.done() and ran_on == [threading.current_thread()]
    engine.wait(handle)
    assert engine.stats.num_copies == 1
    assert engine.stats.exposed_seconds == engine.stats.copy_seconds
    assert engine.stats.overlapped_seconds == 0.0


def test_async_copies_run_in_order_on_the_worker_and_overlap():
    engine = KVCopyEngine("async")
    gate = threading.Event()
    order: list[int] = []
    src = torch.arange(12.0).reshape(3, 4)
    dst = torch.zeros(3, 4)
    first = engine.submit(lambda: (gate.wait(), order.append(0)))
    second = engine.submit(lambda: (dst.index_copy_(0, torch.tensor([2, 0, 1]), src),
                                    order.append(1)))
    assert not first.done() and not second.done()          # queued behind the gate
    gate.set()
    while not second.done():                               # the main thread does other work
        time.sleep(0.001)
    engine.wait(first)
    engine.wait(second)                                    # both done: no exposed time
    assert order == [0, 1]
    assert torch.equal(dst, src[[1, 2, 0]])
    assert engine.stats.exposed_seconds == 0.0
    assert engine.stats.overlapped_seconds == engine.stats.copy_seconds > 0.0
    engine.close()


def test_async_wait_blocks_until_done_and_reraises_errors():
    engine = KVCopyEngine("async")
    gate = threading.Event()
    finished = []
    handle = engine.submit(lambda: (gate.wait(), finished.append(True)))
    threading.Timer(0.05, gate.set).start()
    engine.wait(handle)
    assert finished == [True] and handle.done()

    def broken():
        raise OSError("disk full")

    bad = engine.submit(broken)
    with pytest.raises(RuntimeError, match="swap copy failed") as info:
        engine.wait(bad)
    assert isinstance(info.value.__cause__, OSError)
    ok = engine.submit(lambda: finished.append(True))       # the worker survives an error
    engine.wait(ok)
    assert finished == [True, True]
    engine.close()
