"""Tokenizer over SmolLM2's GGUF vocabulary: ids, round trips, chat template, stop ids."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvforge.tokenizer import Tokenizer
from tests.helpers.reference_bpe import ReferenceBPE

TEXTS = ["Hello", "Hello, world! 1234", "naïve café ünïcödé", "世界你好，こんにちは", "🤗 emoji 👨‍👩‍👧 zwj",
         "tabs\tand\nnewlines\n\n  spaces", "a . b , c ' s", "<|im_start|>user",
         "It's 3.14159 -- don't  stop", "x<|im_end|>\n<|im_start|>assistant\n  ",
         "   leading and trailing   "]

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tok(default_model_path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path)


def test_vocabulary_facts(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert {0, 1, 2} <= set(tok.all_special_ids)
    # eos of SmolLM2 is <|im_end|> itself, so the chat end token adds nothing new
    assert tok.eos_token_ids == (2,)


@pytest.fixture(scope="module")
def reference(default_model_path) -> ReferenceBPE:
    return ReferenceBPE.from_gguf(default_model_path)


def test_encode_matches_reference_bpe_and_round_trips(tok, reference):
    """Against BPE written from llama.cpp's definition over the GGUF's own vocabulary and merges
    (tests/helpers/reference_bpe.py), not the transformers tokenizer this class wraps."""
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_known_ids(tok):
    assert tok.encode("Hello") == [19556]
    # the emoji spans byte-level tokens that are not characters on their own
    assert tok.encode(" 🤗") == [15107, 114, 241]
    assert tok.encode("<|im_start|>user") == [1, 4093]     # special token parsed from text


def test_decode_skips_special_tokens(tok):
    ids = [1, 19556, 2]
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.render_chat(messages) == expected
    assert tok.render_chat(messages, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n")

    ids = tok.apply_chat_template(messages)
    reference = tok.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(reference)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert ids[-4:] == [1, 520, 9531, 198]                   # "<|im_start|>assistant\n"


def test_chat_with_system_message(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = tok.render_chat(messages)
    assert SYSTEM not in text and text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.count("<|im_start|>") == 5


def test_chat_end_token_joins_eos(tokenizer_dir):
    # a tokenizer whose eos is <|endoftext|> must still stop at the template's <|im_end|>
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tokenizer_dir, eos_token="<|endoftext|>")
    assert Tokenizer(hf).eos_token_ids == (0, 2)
    assert Tokenizer(hf, extra_eos_token_ids=[7, 0]).eos_token_ids == (0, 7, 2)


def test_bad_inputs(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(ValueError, match="str"):
        tok.encode(["not", "a", "string"])
    with pytest.raises(ValueError, match="non-empty"):
        tok.render_chat([])
    tok.hf_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_cache_round_trip(tmp_path, monkeypatch, default_model_path):
    """The tokenizer saved in the cache dir encodes, decodes and templates like the GGUF one."""
    from kvforge.tokenizer import Tokenizer, _gguf_tokenizer_cache_dir
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    fresh = Tokenizer.from_gguf(default_model_path)          # builds and fills the cache
    cache = _gguf_tokenizer_cache_dir(default_model_path)
    assert cache.startswith(str(tmp_path)) and (tmp_path / "tokenizers").is_dir()
    assert (Path(cache) / "source.json").is_file()            # what it was converted from
    cached = Tokenizer.from_gguf(default_model_path)         # loads from the cache
    text = "Hello wörld 🤖 — 東京 <|im_end|>\n  spaces"
    assert cached.encode(text) == fresh.encode(text)
    assert cached.eos_token_ids == fresh.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(msgs) == fresh.apply_chat_template(msgs)


def test_gguf_tokenizer_cache_drops_entries_of_files_gone_or_changed(tmp_path):
    """Writing an entry prunes those whose GGUF file was deleted or rewritten (their keys can
    never be asked for again); live ones and entries without a recorded source stay."""
    from kvforge.tokenizer import _prune_stale_entries, _record_source
    root = tmp_path / "tokenizers"
    files = {}
    for name in ("kept", "deleted", "rewritten"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"GGUF" + name.encode())
        (root / name).mkdir(parents=True)
        _record_source(str(root / name), str(files[name]))
    (root / "legacy").mkdir()
    (root / "legacy-unused").mkdir()                  # no source, untouched for 8 days
    eight_days_ago = time.time() - 8 * 24 * 3600
    os.utime(root / "legacy-unused", (eight_days_ago, eight_days_ago))
    files["deleted"].unlink()
    files["rewritten"].write_bytes(b"GGUF, longer now")
    _prune_stale_entries(str(root))
    assert sorted(p.name for p in root.iterdir()) == ["kept", "legacy"]


def test_a_hit_on_an_entry_without_a_source_records_it(tmp_path, monkeypatch,
                                                       default_model_path):
    """Entries written before sources were kept gain one when a load uses them, so pruning
    can tell them from the abandoned ones."""
    from kvforge.tokenizer import Tokenizer, _gguf_tokenizer_cache_dir, _source_stamp
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    Tokenizer.from_gguf(default_model_path)
    source = Path(_gguf_tokenizer_cache_dir(default_model_path)) / "source.json"
    source.unlink()                                    # as an older version left it
    Tokenizer.from_gguf(default_model_path)
    assert json.loads(source.read_text()) == _source_stamp(os.path.abspath(default_model_path))
