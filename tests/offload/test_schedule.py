"""The zig-zag block order, the batch split and the projection groups."""
import pytest

from kvforge.offload.schedule import group_batches, split_batches, zigzag_order


def test_zigzag_walks_layers_column_by_column_alternating_direction():
    assert zigzag_order(3, 3) == [(0, 0), (0, 1), (0, 2),
                                  (1, 2), (1, 1), (1, 0),
                                  (2, 0), (2, 1), (2, 2)]


def test_zigzag_visits_every_layer_batch_once_and_finishes_a_layer_before_the_next():
    order = zigzag_order(5, 4)
    assert sorted(order) == [(j, k) for j in range(5) for k in range(4)]
    layers = [j for j, _ in order]
    assert layers == sorted(layers)          # one weight load per layer serves all batches


def test_zigzag_consecutive_layers_meet_on_the_same_batch():
    order = zigzag_order(4, 3)
    for i in range(3, len(order), 3):
        assert order[i - 1][1] == order[i][1]


def test_split_batches_and_bad_sizes():
    assert split_batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_batches(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match="batch_size"):
        split_batches(3, 0)
    with pytest.raises(ValueError, match="num_batches"):
        zigzag_order(2, 0)


def test_group_batches_joins_consecutive_batches_up_to_the_row_limit():
    # a decode block (2 rows a batch) is one group; prefill batches split where rows run out
    assert group_batches([2, 2, 2, 1], 512) == [[0, 1, 2, 3]]
    assert group_batches([5, 3, 4, 9, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    assert group_batches([], 8) == []
    with pytest.raises(ValueError, match="max_rows"):
        group_batches([1], 0)
