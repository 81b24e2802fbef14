"""MLFQ and swap-copy engine options: CLI flags -> EngineConfig -> the engine's queue; bad values
raise a ValueError naming them before any engine exists."""
import pytest

from kvforge import LLM
from kvforge.config import EngineConfig
from kvforge.sched.mlfq import MLFQConfig
from tests.helpers.cli import engine_config_from_flags


def test_defaults_are_the_documented_ones():
    cfg = EngineConfig()
    assert cfg.mlfq == MLFQConfig()
    assert (cfg.mlfq.quanta, cfg.mlfq.starvation_steps, cfg.mlfq.prefill_weight) == (
        (8, 32, 128, 512), 256, 0.1)
    assert (cfg.swap_copy_mode, cfg.swap_prefetch) == ("auto", True)
    assert engine_config_from_flags([]).mlfq == cfg.mlfq


def test_flags_reach_the_config():
    cfg = engine_config_from_flags(["--scheduling-policy", "mlfq", "--mlfq-quanta", "8,32,128,512",
                                    "--mlfq-starvation-steps", "40", "--mlfq-prefill-weight", "0.1",
                                    "--preemption-mode", "swap", "--swap-copy-mode", "sync",
                                    "--no-swap-prefetch"])
    assert cfg.mlfq.quanta == (8, 32, 128, 512) and cfg.mlfq.num_levels == 5
    assert (cfg.mlfq.starvation_steps, cfg.mlfq.prefill_weight) == (40, 0.1)
    assert (cfg.swap_copy_mode, cfg.swap_prefetch) == ("sync", False)


@pytest.mark.parametrize("kwargs,bad", [
    (dict(mlfq_quanta="64,32"), "'64,32'"),
    (dict(mlfq_quanta="64,x"), "'64,x'"),
    (dict(mlfq_quanta="0,8"), "'0,8'"),
    (dict(mlfq_quanta=[4, 4]), "[4, 4]"),
    (dict(mlfq_quanta=""), "''"),
    (dict(mlfq_quanta=64), "64"),
    (dict(mlfq_starvation_steps=0), "starvation_steps must be a positive integer, got 0"),
    (dict(mlfq_starvation_steps=2.5), "got 2.5"),
    (dict(mlfq_prefill_weight=0.0), "prefill_weight .* got 0.0"),
    (dict(mlfq_prefill_weight=3), "prefill_weight .* got 3"),
    (dict(swap_copy_mode="fast"), "'fast'"),
])
def test_bad_values_are_named(kwargs, bad):
    with pytest.raises(ValueError, match=bad.replace("[", r"\[")):
        EngineConfig(**kwargs)


def test_bad_flag_value_fails_before_an_engine_exists():
    with pytest.raises(ValueError, match="'1024,256'"):
        engine_config_from_flags(["--mlfq-quanta", "1024,256"])


def test_the_engine_queue_uses_the_options(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=3)
    llm = LLM(path, num_kv_blocks=32, scheduling_policy="mlfq", mlfq_quanta=(8, 32),
              mlfq_starvation_steps=12, mlfq_prefill_weight=0.5)
    queue = llm.engine.scheduler.waiting
    assert queue.config == MLFQConfig(quanta=(8, 32), starvation_steps=12, prefill_weight=0.5)
    # skip-join uses the weight: a 20-token prompt is 10 of work -> level 1 (quantum 32)
    llm.engine.add_request("r", list(range(5, 25)))
    assert queue.level_of(llm.engine.scheduler.get_request("r")) == 1
    llm.engine.abort_request("r")
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == 32
