"""The placement LP against constructed costs: sane choices, the budget, and no worse than an
exhaustive search of every placement and block size."""
import itertools

import pytest

from kvforge.offload.calibrate import HardwareCosts
from kvforge.offload.cost_model import (ModelFacts, Workload, decode_step_s, fast_tier_bytes,
                                        layer_compute_s, layer_load_s)
from kvforge.offload.policy import (BLOCK_GAIN_MIN, MAX_BLOCK_BATCHES, PolicySpec,
                                    choose_placement, parse_policy)

MiB = 2 ** 20
FACTS = ModelFacts(num_layers=6, layer_bytes=10 * MiB, layer_params=2_500_000,
                   head_bytes=20 * MiB, head_params=5_000_000, stage_bytes=10 * MiB,
                   hidden_size=256, intermediate_size=1024, vocab_size=8000,
                   kv_bytes_per_token_layer=2048, fixed_bytes=MiB)
WORK = Workload(seq_len=64, step_tokens=512, block_size=16)


def hw(disk_mb_s: float, s_per_mparam: float = 1e-3, contended_mb_s: float | None = None,
       slowdown: float = 1.0) -> HardwareCosts:
    return HardwareCosts(disk_read_bytes_per_s=disk_mb_s * 1e6,
                         disk_write_bytes_per_s=disk_mb_s * 1e6,
                         linear_s_per_mparam={1: s_per_mparam, 8: s_per_mparam,
                                              64: 4 * s_per_mparam},
                         memory_bytes_per_s=10e9, per_layer_call_s=1e-4,
                         disk_read_contended_bytes_per_s=(
                             None if contended_mb_s is None else contended_mb_s * 1e6),
                         compute_contended_slowdown=slowdown)


def exhaustive_best(costs, budget, batch_size, max_nb=12, min_nb=1):
    best = 0.0
    L = FACTS.num_layers
    for nb in range(min_nb, max_nb + 1):
        for counts in itertools.product(range(L + 1), repeat=4):
            if sum(counts) != L:
                continue
            resident, kv_ram = counts[0] + counts[2], counts[0] + counts[1]
            if fast_tier_bytes(FACTS, WORK, batch_size, nb, resident, kv_ram, 2) > budget:
                continue
            step = decode_step_s(FACTS, costs, WORK, batch_size, nb, counts, True)
            best = max(best, batch_size * nb / step)
    return best


@pytest.mark.parametrize("contention", [None, (0.6, 1.5)])
@pytest.mark.parametrize("disk_mb_s", [50, 500, 5000])
@pytest.mark.parametrize("budget_mib", [30, 45, 80])
def test_lp_matches_exhaustive_search_and_fits_the_budget(disk_mb_s, budget_mib, contention):
    costs = (hw(disk_mb_s) if contention is None
             else hw(disk_mb_s, contended_mb_s=contention[0] * disk_mb_s, slowdown=contention[1]))
    budget = budget_mib * MiB
    p = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, budget, 4, None)
    assert p.fast_tier_bytes <= budget
    used = fast_tier_bytes(FACTS, WORK, 4, p.block_batches, len(p.resident_layers),
                           FACTS.num_layers - len(p.kv_disk_layers), p.slots)
    assert used <= budget
    best = exhaustive_best(costs, budget, 4, max_nb=MAX_BLOCK_BATCHES)
    # the largest block within BLOCK_GAIN_MIN of the best prediction is taken
    assert p.predicted_tokens_per_s >= best / BLOCK_GAIN_MIN * 0.999
    for nb in range(p.block_batches + 1, MAX_BLOCK_BATCHES + 1):
        assert exhaustive_best(costs, budget, 4, max_nb=nb, min_nb=nb) < best / BLOCK_GAIN_MIN
    for nb in (1, 3, 8):                  # at a given block size the placement is optimal
        try:
            fixed = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, budget, 4, nb)
        except ValueError:
            assert exhaustive_best(costs, budget, 4, max_nb=nb, min_nb=nb) == 0.0
            continue
        assert fixed.predicted_tokens_per_s >= exhaustive_best(
            costs, budget, 4, max_nb=nb, min_nb=nb) * 0.999


def test_slow_disk_keeps_as_many_weights_resident_as_fit():
    costs = hw(20)                 # a layer takes 0.5 s to read: loads dominate
    assert layer_load_s(FACTS, costs) > 10 * layer_compute_s(FACTS, costs, WORK, 4, 1)
    base = fast_tier_bytes(FACTS, WORK, 4, 1, 0, FACTS.num_layers, 2)
    budget = base + 3 * FACTS.layer_bytes + MiB // 2
    p = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, budget, 4, 1)
    assert len(p.resident_layers) == 3
    assert p.kv_disk_layers == []            # KV of one small batch fits in RAM
    more = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, budget + 2 * FACTS.layer_bytes,
                            4, 1)
    assert len(more.resident_layers) == 5
    assert more.predicted_tokens_per_s > p.predicted_tokens_per_s


def test_big_blocks_spill_kv_to_disk_when_it_does_not_fit():
    costs = hw(2000, s_per_mparam=5e-3)        # compute-bound: the LP wants big blocks
    p = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, 52 * MiB, 4, 12)
    kv_all_ram = fast_tier_bytes(FACTS, WORK, 4, 12, 0, FACTS.num_layers, 2)
    assert kv_all_ram > 52 * MiB
    assert p.kv_disk_layers                    # some layers keep their KV on disk
    assert p.fast_tier_bytes <= 52 * MiB


def test_lp_prefers_larger_blocks_when_weights_stream():
    costs = hw(200)
    small = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, 60 * MiB, 4, 1)
    chosen = choose_placement(PolicySpec("lp"), FACTS, costs, WORK, 60 * MiB, 4, None)
    assert chosen.block_batches > 1
    assert chosen.predicted_tokens_per_s > 2 * small.predicted_tokens_per_s


def test_naive_streams_everything_without_overlap():
    costs = hw(500)
    p = choose_placement(PolicySpec("naive"), FACTS, costs, WORK, 60 * MiB, 4, None)
    assert (p.block_batches, p.counts, p.overlap, p.slots) == (1, (0, 6, 0, 0), False, 1)
    per_layer = layer_load_s(FACTS, costs) + layer_compute_s(FACTS, costs, WORK, 4, 1)
    assert p.predicted_step_s > 6 * per_layer


def test_explicit_policy_is_obeyed_and_a_tiny_budget_is_refused():
    costs = hw(500)
    p = choose_placement(parse_policy("w=50,kv=100"), FACTS, costs, WORK, 80 * MiB, 4, 2)
    assert len(p.resident_layers) == 3 and p.kv_disk_layers == []
    with pytest.raises(ValueError, match="offload_memory_budget 5.0 MiB is too small"):
        choose_placement(PolicySpec("lp"), FACTS, costs, WORK, 5 * MiB, 4, None)


@pytest.mark.parametrize("bad", ["fast", "w=150", "w=10,w=20", "kv=", 3])
def test_parse_policy_rejects(bad):
    with pytest.raises(ValueError, match="offload_policy"):
        parse_policy(bad)


def test_overlap_without_contention_is_the_longer_of_the_two():
    costs = hw(500)
    assert costs.overlapped_seconds(0.3, 0.5) == pytest.approx(0.5)
    assert costs.overlapped_seconds(0.7, 0.2) == pytest.approx(0.7)
    assert costs.overlapped_seconds(0.0, 0.2) == pytest.approx(0.2)


def test_overlap_under_contention_runs_both_slowed_then_the_rest_alone():
    costs = hw(500, contended_mb_s=250, slowdown=1.5)     # reads at half rate, compute 1.5x
    # io 0.2 s alone -> 0.4 s beside compute; compute 1.0 s alone -> 1.5 s beside reads.
    # Reads end at 0.4 s, with 0.4 / 1.5 of the compute done; the rest alone: 1.0 * (1 - 4/15)
    assert costs.overlapped_seconds(0.2, 1.0) == pytest.approx(0.4 + 1.0 * (1 - 0.4 / 1.5))
    # io-bound: compute ends at 0.15 s with 0.15 / 0.8 of the reads done, the rest at full rate
    assert costs.overlapped_seconds(0.4, 0.1) == pytest.approx(0.15 + 0.4 * (1 - 0.15 / 0.8))
    for io, compute in [(0.2, 1.0), (1.0, 1.0), (0.4, 0.1)]:
        assert costs.overlapped_seconds(io, compute) > max(io, compute)


def test_contention_lowers_the_lp_prediction_of_a_streaming_placement():
    quiet, contended = hw(200), hw(200, contended_mb_s=120, slowdown=1.5)
    a = choose_placement(PolicySpec("lp"), FACTS, quiet, WORK, 60 * MiB, 4, None)
    b = choose_placement(PolicySpec("lp"), FACTS, contended, WORK, 60 * MiB, 4, None)
    assert b.predicted_tokens_per_s < a.predicted_tokens_per_s
    # the naive policy does not overlap, so contention does not touch its prediction
    na = choose_placement(PolicySpec("naive"), FACTS, quiet, WORK, 60 * MiB, 4, None)
    nb = choose_placement(PolicySpec("naive"), FACTS, contended, WORK, 60 * MiB, 4, None)
    assert na.predicted_step_s == pytest.approx(nb.predicted_step_s)
