"""Incremental detokenization: deltas hold back incomplete characters and add up exactly."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvforge.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from kvforge.tokenizer import Tokenizer

STREAMS = ["Hello 🤗 世界!", "👨‍👩‍👧 family, 日本語のテキスト, Ελληνικά, emoji 🎉🎉",
           "plain ascii text with spaces  and\nnewlines", "é" * 5 + "🤗" * 3]
PROMPT = [1, 4093, 198]


@pytest.fixture(scope="module")
def tok(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tokenizer_dir)


def stream(tok, ids, chunk=1, **kw):
    detok = IncrementalDetokenizer(tok, PROMPT, **kw)
    deltas = [detok.step(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, deltas


@pytest.mark.parametrize("text", STREAMS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_token_stream_reassembles_text(tok, text, chunk):
    ids = tok.encode(text)
    detok, deltas = stream(tok, ids, chunk)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == text == tok.decode(ids)
    assert detok.flush() == ""


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode(" 🤗")                     # three byte-level tokens, one character
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, PROMPT)
    assert detok.step(ids[:1]) == ""
    assert detok.step(ids[1:2]) == ""
    assert detok.step(ids[2:]) == " 🤗"


def test_invalid_bytes_emit_replacement_once_completed(tok):
    lead, cont = tok.encode("🤗")[0], tok.encode("世")[-1]   # a 4-byte lead; a stray byte
    hello = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, PROMPT)
    assert detok.step([lead]) == ""              # may still become a character
    out = detok.step(hello)                      # now it never can: U+FFFD, then the text
    assert out == tok.decode([lead] + hello) and out.startswith(REPLACEMENT_CHAR)
    # a stream that ends inside a character is flushed at the end
    assert detok.step([cont]) == ""
    assert detok.flush() == tok.decode([cont]) == REPLACEMENT_CHAR
    assert detok.output_text == tok.decode([lead] + hello + [cont])


def test_literal_replacement_character_is_emitted_on_flush(tok):
    ids = tok.encode("ok \ufffd")
    detok, deltas = stream(tok, ids)
    assert "".join(deltas) + detok.flush() == "ok \ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("Hi") + [2, 1] + tok.encode("🤗 there") + [0]
    detok, deltas = stream(tok, ids, skip_special_tokens=skip)
    detok.flush()
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is (not skip)


def test_each_step_decodes_a_short_window(tok):
    calls = []
    real_decode = tok.decode

    def spy(ids, skip_special_tokens=True):
        calls.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    ids = tok.encode("The quick brown fox 🦊 jumps over the lazy dog. " * 20)
    assert len(ids) > 200
    tok.decode = spy
    try:
        detok, _ = stream(tok, ids)
    finally:
        del tok.decode
    assert detok.output_text == tok.decode(ids)
    assert max(calls) <= 8          # O(window), not O(output)




@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_sequence_matches_full_decode(tok, data):
    pool = sorted(set(tok.encode("🤗世界é👨‍👩‍👧 a\n")) | {0, 1, 2, 19556, 24211})
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=25))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, PROMPT, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    i = 0
    while i < len(ids):
        n = data.draw(st.integers(1, 4))
        delta = detok.step(ids[i:i + n])
        i += n
        assert not delta.endswith(REPLACEMENT_CHAR)        # held until completed or flushed
        assert full.startswith(detok.output_text)
    detok.flush()
    assert detok.output_text == full
