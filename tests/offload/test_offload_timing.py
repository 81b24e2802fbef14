"""The offloaded step's stage protocol under adversarial thread timing: random delays in the
weight loader's, the KV loader's and the store thread's I/O, with placements that mix RAM-KV,
disk-KV and resident layers, steps with fewer batches than the block, steps that need no logits
(chunked prefill), preemption (a KV pool too small for every sequence), the last steps where
the block empties, and projection groups smaller than the step (several groups a layer, a
group's RAM-KV attention on its own metadata). Greedy tokens must equal the in-memory run's and no order check may fire."""
import random
import time

import pytest

from kvforge import LLM, SamplingParams
from tests.offload.conftest import greedy_in_memory
from tests.offload.test_offloaded_engine import PROMPTS as ENGINE_PROMPTS
from kvforge.offload import kv_disk, loader, streamed_model

# the engine tests' prompts and two more: 8 sequences, so blocks of several batches
PROMPTS = [*ENGINE_PROMPTS, "Robot number 7 lived near the harbour", "A B C"]
PARAMS = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    d, _ = tiny_model_factory("llama", num_hidden_layers=5)
    return d


@pytest.fixture(scope="module")
def in_memory_tokens(tiny_dir):
    return greedy_in_memory(tiny_dir, PROMPTS, PARAMS)


@pytest.fixture
def jittered_io(monkeypatch):
    """Sleep 0-3 ms (seeded) before every stage read and every KV write-back, so the loader
    and store threads finish in orders the quiet machine never shows."""
    rng = random.Random(1234)
    read, write = loader.StageLoader._read, kv_disk.DiskKVLayer.write

    def slow_read(self, slot, stage):
        time.sleep(rng.random() * 0.003)
        read(self, slot, stage)

    def slow_write(self, num_local, runs, buf):
        time.sleep(rng.random() * 0.003)
        write(self, num_local, runs, buf)

    monkeypatch.setattr(loader.StageLoader, "_read", slow_read)
    monkeypatch.setattr(kv_disk.DiskKVLayer, "write", slow_write)


@pytest.mark.parametrize("policy, block_batches, num_kv_blocks, group_rows", [
    ("w=0,kv=20", 8, None, None),   # the grid point that once stopped: RAM-KV layer 0, rest disk
    ("w=0,kv=40", 3, None, None),
    ("w=40,kv=0", 2, None, None),   # resident layers first, every layer's KV on disk
    ("w=20,kv=60", 4, None, None),
    ("w=0,kv=20", 8, 12, None),     # a pool too small for the block: preemption
    ("w=0,kv=40", 3, None, 5),      # groups of 1-2 batches: several per layer and step
    ("w=20,kv=60", 4, 12, 3),       # prefill batches larger than a group, and preemption
])
def test_stage_protocol_under_io_jitter(tiny_dir, tmp_path, in_memory_tokens, jittered_io,
                                        monkeypatch, policy, block_batches, num_kv_blocks,
                                        group_rows):
    if group_rows is not None:
        monkeypatch.setattr(streamed_model, "DENSE_GROUP_ROWS", group_rows)
    llm = LLM(tiny_dir, max_model_len=128, offload_dir=str(tmp_path),
              offload_memory_budget="64MiB", offload_policy=policy, offload_batch_size=2,
              offload_block_batches=block_batches, num_kv_blocks=num_kv_blocks,
              max_num_batched_tokens=24, enable_prefix_caching=False)
    model = llm.engine.runner.model
    for _ in range(2):            # a second generate starts from the first one's last step
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == in_memory_tokens
        llm.engine.check_integrity()
    assert model.loader.outstanding() == 0
    assert model.kv_disk                      # KV went through the disk tier
    llm.engine.shutdown()
