"""The disk KV slot map: a step's written blocks move to one fresh run, their old slots free
only at commit, a failed step keeps the old ones; check_integrity catches a broken map."""
import random

import pytest

from kvforge.offload.kv_slots import DiskSlotMap


def test_a_steps_blocks_take_one_contiguous_run_in_the_order_given():
    m = DiskSlotMap(8)                         # blocks 0..7 at slots 0..7, slots 8..15 free
    runs = m.reserve([5, 2, 7, 2])
    assert runs == [(8, [5, 2, 7])]
    assert [m.slot_reserved(b) for b in (5, 2, 7)] == [8, 9, 10]
    assert m.slot_of[5] == 5                   # still read at the old slot until commit
    m.check_integrity()
    m.commit()
    assert [m.slot_of[b] for b in (5, 2, 7)] == [8, 9, 10]
    assert m.num_free == 8                     # 5, 2, 7 freed; 8, 9, 10 taken
    m.check_integrity()


def test_the_slots_a_step_frees_are_the_next_steps_run():
    m = DiskSlotMap(4)                         # slots 4..7 free
    assert m.reserve([0, 1]) == [(4, [0, 1])]
    m.commit()                                 # 0 -> 4, 1 -> 5; slots 0, 1 free
    assert m.reserve([2, 3]) == [(0, [2, 3])]  # the lowest free run
    m.commit()
    assert m.reserve([0, 1]) == [(2, [0, 1])]
    m.commit()
    assert m.slot_of == [2, 3, 0, 1] and m.num_free == 4
    m.check_integrity()


def test_a_fragmented_file_gives_several_runs_covering_every_block():
    m = DiskSlotMap(4, capacity=6)             # free: 4, 5
    m.reserve([0])
    m.commit()                                 # 0 -> 4; free 0, 5
    runs = m.reserve([1, 2])
    assert [len(b) for _, b in runs] == [1, 1] and {f for f, _ in runs} == {0, 5}
    assert {m.slot_reserved(1), m.slot_reserved(2)} == {0, 5}
    m.check_integrity()


def test_rollback_keeps_the_old_slots_and_frees_the_reserved_ones():
    m = DiskSlotMap(4)
    m.reserve([1, 3])
    m.rollback()
    assert m.slot_of == [0, 1, 2, 3] and m.num_free == 4
    m.check_integrity()


def test_a_block_reserved_by_two_batches_of_a_step_is_refused():
    m = DiskSlotMap(4)
    m.reserve([1])
    with pytest.raises(ValueError, match=r"blocks \[1\] already reserved"):
        m.reserve([2, 1])


def test_random_steps_keep_the_map_whole():
    rng = random.Random(0)
    m = DiskSlotMap(32)
    for _ in range(300):
        blocks = rng.sample(range(32), rng.randint(1, 32))
        runs = m.reserve(blocks)
        assert [b for _, bs in runs for b in bs] == blocks
        m.check_integrity()
        (m.commit if rng.random() < 0.8 else m.rollback)()
        m.check_integrity()


def test_check_integrity_catches_a_shared_slot_and_a_lost_free_mark():
    m = DiskSlotMap(4)
    m.slot_of[2] = 1
    with pytest.raises(AssertionError, match="share a disk slot"):
        m.check_integrity()
    m = DiskSlotMap(4)
    m._free[6] = 0
    with pytest.raises(AssertionError, match="slot 6 is taken but unused"):
        m.check_integrity()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks=4, capacity=3"):
        DiskSlotMap(4, capacity=3)
