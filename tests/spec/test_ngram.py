"""NgramProposer: the longest earlier match, its latest occurrence, truncation, no match."""
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


def test_the_longest_match_beats_a_later_shorter_one_past_four_tokens():
    #         0  1  2  3  4  5  6    7  8  9 10 11    12 13 14 15 16 17
    tokens = [1, 2, 3, 4, 5, 6, 70, 3, 4, 5, 6, 90, 1, 2, 3, 4, 5, 6]
    # "1 2 3 4 5 6" occurred at 0 (followed by 70); its last four, "3 4 5 6", also at 7
    # (followed by 90), later: a 4-token limit takes the later, shorter match
    assert NgramProposer(1, 32).propose_matched(tokens, 2) == ([70, 3], 6)
    assert NgramProposer(1, 4).propose_matched(tokens, 2) == ([90, 1], 4)


def test_match_length_reported_and_min_n_respected():
    tokens = [5, 6, 7, 8, 6, 7]
    assert NgramProposer(1, 32).propose_matched(tokens, 3) == ([8, 6, 7], 2)
    assert NgramProposer(3, 32).propose_matched(tokens, 3) == ([], 0)
    # a run of one token matches itself shifted by one: the match may overlap the suffix
    assert NgramProposer(1, 32).propose_matched([4, 4, 4, 4], 2) == ([4], 3)


def test_agrees_with_a_brute_force_search_on_random_tokens():
    import random
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        max_n = rng.randrange(1, 10)
        best_n, best_end = 0, None
        for n in range(1, min(max_n, len(tokens) - 1) + 1):
            ends = [e for e in range(n - 1, len(tokens) - 1)
                    if tokens[e - n + 1:e + 1] == tokens[-n:]]
            if ends:
                best_n, best_end = n, ends[-1]
        expected = (tokens[best_end + 1:best_end + 4], best_n) if best_n else ([], 0)
        assert NgramProposer(1, max_n).propose_matched(tokens, 3) == expected, (tokens, max_n)
