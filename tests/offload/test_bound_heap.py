"""An offloaded engine fixes glibc's mmap threshold before it allocates: a large block freed
then no longer moves the threshold up, so later activations of that size are mapped on their
own (and unmapped when freed) instead of fragmenting the heap above the memory budget."""
import os
import subprocess
import sys

import pytest

from kvforge.offload import runner, streamed_model

pytestmark = pytest.mark.skipif(streamed_model._LIBC is None, reason="glibc's malloc only")

# malloc a block, read glibc's chunk header (the size word before the pointer: bit 1 =
# IS_MMAPPED), free it; first free a 16 MiB block, which raises the dynamic threshold to 16 MiB
PROBE = """
import ctypes, sys
from kvforge.offload import streamed_model
libc = streamed_model._LIBC
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(16 << 20))
if sys.argv[1] == "bound":
    streamed_model.bound_heap()
p = libc.malloc(2 << 20)
size_word = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value
libc.free(p)
print("mmapped" if size_word & 2 else "heap")
"""


@pytest.mark.parametrize("mode, where", [("bound", "mmapped"), ("free", "heap")])
def test_a_2_mib_block_after_a_16_mib_free(mode, where):
    # glibc's own malloc with its defaults (no tunables, no preloaded allocator)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == where


def test_an_offloaded_engine_bounds_the_heap(monkeypatch, tmp_path, tiny_model_factory):
    calls = []
    monkeypatch.setattr(runner, "bound_heap", lambda: calls.append(1))
    from kvforge import LLM
    d, _ = tiny_model_factory("llama", num_hidden_layers=2)
    llm = LLM(d, max_model_len=64, offload_dir=str(tmp_path), offload_memory_budget="64MiB",
              enable_prefix_caching=False)
    assert len(calls) == 1
    llm.engine.shutdown()
