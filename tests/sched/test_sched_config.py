import pytest

from kvforge.sched.config import SchedulerConfig


def test_defaults():
    cfg = SchedulerConfig()
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.enable_chunked_prefill,
            cfg.policy) == (2048, 128, True, "fcfs")


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                   "block_size"])
def test_non_positive_values_rejected_by_name(field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_unchunked_prefill_needs_budget_for_longest_prompt():
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=True)


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="'round-robin'"):
        SchedulerConfig(policy="round-robin")
    assert SchedulerConfig(policy="priority").policy == "priority"
