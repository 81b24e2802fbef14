"""NgramProposer: latest occurrence, longest n first, truncation, no match."""
import pytest

from kvforge.spec.ngram import NgramProposer


def test_latest_occurrence_of_the_suffix_wins():
    p = NgramProposer(min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9  10
    tokens = [7, 8, 9, 1, 7, 8, 9, 2, 5, 7, 8]
    # suffix "7 8" last occurred at 4 (followed by 9 2 5), not at 0
    assert p.propose(tokens, 3) == [9, 2, 5]


def test_longer_match_preferred_over_later_shorter_one():
    p = NgramProposer(min_n=1, max_n=3)
    tokens = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    # n=3 "1 2 3" matches at 0 -> 4 9; n=1 "3" alone would pick position 5 -> 5
    assert p.propose(tokens, 2) == [4, 9]


def test_proposal_stops_at_the_end_of_the_tokens():
    p = NgramProposer(min_n=1, max_n=2)
    assert p.propose([4, 5, 6, 4, 5], 10) == [6, 4, 5]


def test_no_match_and_too_short():
    p = NgramProposer(min_n=2, max_n=3)
    assert p.propose([1, 2, 3, 4, 5], 4) == []
    assert p.propose([1, 2], 4) == []
    assert NgramProposer(1, 1).propose([3], 2) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=0)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_tokens"):
        NgramProposer().propose([1, 1], 0)
