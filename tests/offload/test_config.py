"""Offload engine arguments: validated, with errors naming the bad value."""
import pytest

from kvforge.config import EngineConfig


def test_offload_off_by_default_and_on_with_a_budget(tmp_path):
    assert EngineConfig().offload_memory_budget_bytes is None
    c = EngineConfig(offload_memory_budget="128MiB", offload_dir=str(tmp_path),
                     offload_policy="w=25,kv=50", offload_batch_size=4, offload_block_batches=3)
    assert c.offload_memory_budget_bytes == 128 * 2 ** 20
    assert c.offload_dir_path == str(tmp_path)
    # auto stays auto: the runner streams a GGUF file's own blocks, anything else fp32 rows
    assert c.quantization == "auto"


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload_memory_budget="lots"), "cannot parse memory size 'lots'"),
    (dict(offload_memory_budget=0), "memory size must be > 0"),
    (dict(offload_memory_budget="1GiB", offload_policy="greedy"), "'greedy'"),
    (dict(offload_memory_budget="1GiB", offload_policy="w=120"), "0..100"),
    (dict(offload_memory_budget="1GiB", offload_batch_size=0), "offload_batch_size .* got 0"),
    (dict(offload_memory_budget="1GiB", offload_block_batches=0), "offload_block_batches .* 0"),
    (dict(offload_memory_budget="1GiB", offload_policy="naive", offload_block_batches=4),
     "naive.*offload_block_batches=4"),
    (dict(offload_dir="/tmp/x"), r"\['offload_dir'\] need offload_memory_budget"),
    (dict(offload_policy="naive"), r"\['offload_policy'\] need offload_memory_budget"),
    (dict(offload_memory_budget="1GiB", quantization="int8"), "quantization='int8'"),
    (dict(offload_memory_budget="1GiB", speculative_method="ngram"), "speculative"),
    (dict(offload_memory_budget="1GiB", tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(offload_memory_budget="1GiB", preemption_mode="swap"), "preemption_mode='swap'"),
    (dict(offload_memory_budget="1GiB", sparse_attention="quest"), "sparse_attention='quest'"),
])
def test_bad_offload_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_offload_dir_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        EngineConfig(offload_memory_budget="1GiB", offload_dir=str(f))


def test_cli_flags_reach_the_engine_config(tmp_path):
    import argparse

    from kvforge.cli import add_engine_args, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--offload-memory-budget", "512MiB", "--offload-dir", str(tmp_path),
                         "--offload-policy", "naive", "--offload-batch-size", "4",
                         "--offload-trace", str(tmp_path / "t.json")])
    c = EngineConfig(**engine_kwargs(args))
    assert (c.offload_memory_budget_bytes, c.offload_policy, c.offload_batch_size,
            c.offload_trace) == (512 * 2 ** 20, "naive", 4, str(tmp_path / "t.json"))

