"""StopChecker: EOS, stop ids, stop strings across tokens, limits, min_tokens, safe streaming."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.stop_checker import StopChecker
from kvforge.sampling_params import SamplingParams

EOS = 2
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def feed(pieces: list[str], tokens: list[int] | None = None, max_model_len: int = 1000,
         prompt_len: int = 3, **params):
    """Run a request through the checker piece by piece, as the engine does.

    Returns (result of the last check, final text, streamed text, number of tokens consumed).
    """
    checker = StopChecker(SamplingParams(**params), (EOS,), max_model_len)
    req = Request("r", list(range(10, 10 + prompt_len)), checker.params, eos_token_ids=(EOS,))
    tokens = tokens or [100 + i for i in range(len(pieces))]
    text, streamed, result = "", "", None
    for token, piece in zip(tokens, pieces):
        req.append_output_token(token)
        text += piece
        result = checker.check(req, token, text)
        if result.status is not None:
            if result.text is not None:
                text = result.text
            assert text.startswith(streamed), "streamed text was taken back"
            return result, text, streamed, req.num_output_tokens
        safe = checker.safe_text_len(text)
        assert safe >= len(streamed), "safe length moved backwards"
        streamed = text[:safe]
    return result, text, streamed, req.num_output_tokens


def test_stop_string_split_across_tokens_never_leaks():
    result, text, streamed, n = feed(["Hello", " wo", "r", "ld", " again"], stop=["o world"],
                                     max_tokens=50)
    assert (result.status, result.stop_reason, n) == (STOPPED, "o world", 4)
    assert text == "Hell"
    assert streamed and "Hell".startswith(streamed)


def test_include_stop_str_in_output_keeps_the_stop_string_only():
    result, text, _, _ = feed(["ab", "cSTO", "Pxyz", "tail"], stop=["STOP"],
                              include_stop_str_in_output=True)
    assert result.status == STOPPED and text == "abcSTOP"


def test_earliest_stop_string_wins_whatever_the_list_order():
    result, text, _, _ = feed(["xx", "abcdef"], stop=["def", "bc"])
    assert (result.stop_reason, text) == ("bc", "xxa")


def test_eos_stops_and_its_text_is_dropped():
    result, text, _, _ = feed(["hi", "</s>"], tokens=[5, EOS])
    assert (result.status, result.stop_reason, text) == (STOPPED, None, "hi")
    result, _, _, n = feed(["hi", "</s>", "more"], tokens=[5, EOS, 6], ignore_eos=True)
    assert result.status is None and n == 3


def test_stop_token_id_sets_stop_reason():
    result, text, _, n = feed(["a", "b", "<|end|>", "c"], tokens=[5, 6, 42, 7],
                              stop_token_ids=[42])
    assert (result.status, result.stop_reason, text, n) == (STOPPED, 42, "ab", 3)
    result, text, _, _ = feed(["a", "<|end|>"], tokens=[5, 42], stop_token_ids=[42],
                              include_stop_str_in_output=True)
    assert text == "a<|end|>"


def test_max_tokens_and_context_limit_finish_with_length():
    result, _, _, n = feed(list("abcdefgh"), max_tokens=5)
    assert (result.status, n) == (LENGTH, 5)
    # prompt 3 + 4 outputs fills a 7-token context
    result, _, _, n = feed(list("abcdefgh"), max_tokens=None, max_model_len=7)
    assert (result.status, n) == (LENGTH, 4)


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length():
    result, _, _, _ = feed(["a", "b"], tokens=[5, EOS], max_tokens=2)
    assert result.status == STOPPED


def test_min_tokens_suppresses_every_stop_but_not_the_context_limit():
    params = dict(min_tokens=4, stop=["x"], stop_token_ids=[42], max_tokens=10)
    result, _, _, n = feed(["x", "a", "b", "c", "d"], tokens=[EOS, 42, 5, 6, 7], **params)
    assert result.status is None and n == 5
    # the 4th output is the first that may stop
    result, text, _, n = feed(["a", "b", "c", "x", "d"], **params)
    assert (result.status, text, n) == (STOPPED, "abc", 4)
    result, _, _, n = feed(list("abcdef"), max_model_len=5, **params)
    assert (result.status, n) == (LENGTH, 2)


def test_safe_text_len_holds_back_a_possible_stop_prefix():
    checker = StopChecker(SamplingParams(stop=["END", "Z"]), (EOS,), 100)
    assert checker.safe_text_len("hello E") == 5
    assert checker.safe_text_len("h") == 0
    assert StopChecker(SamplingParams(), (EOS,), 100).safe_text_len("hello") == 5


def test_update_rejects_inconsistent_text_and_bad_limits():
    checker = StopChecker(SamplingParams(), (EOS,), 100)
    with pytest.raises(ValueError, match="new_text"):
        checker.update(5, "xyz", "abc", 1, 4)
    with pytest.raises(ValueError, match="max_model_len"):
        StopChecker(SamplingParams(), (EOS,), 0)


def first_stop_reference(pieces: list[str], stops: list[str]) -> str | None:
    """Brute force: the first piece whose arrival completes a stop string decides; among the
    matches ending inside that piece the earliest start wins. Returns the kept text."""
    text = ""
    for piece in pieces:
        before, text = len(text), text + piece
        ends = [(i, i + len(s)) for s in stops for i in range(len(text) - len(s) + 1)
                if text[i:i + len(s)] == s and i + len(s) > before]
        if ends:
            return text[: min(ends)[0]]
    return None


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet="abc", max_size=4), min_size=1, max_size=12),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_against_brute_force(pieces, stops):
    result, text, streamed, _ = feed(pieces, stop=stops, max_tokens=100)
    expected = first_stop_reference(pieces, stops)
    if expected is None:
        assert result.status is None and text == "".join(pieces)
    else:
        assert result.status == STOPPED and text == expected
        assert not any(s in text for s in stops)
    assert text.startswith(streamed)
