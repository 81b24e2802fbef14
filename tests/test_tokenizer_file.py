"""TokenizerFile (tokenizers + jinja2, no transformers) against transformers' own tokenizer on
the same saved files: every GGUF vocabulary here (the default model always; catalogue models
where pulled), encode / decode / special tokens / chat template."""
from __future__ import annotations

import os

import pytest

from kvforge.loader.catalog import CATALOG, pulled_path
from kvforge.tokenizer import Tokenizer
from kvforge.tokenizer_file import TokenizerFile
from tests.test_tokenizer import TEXTS

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcödé 🤖"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


def _models(default_path: str) -> list[str]:
    paths = [default_path]
    for entry in CATALOG.values():
        path = pulled_path(entry)
        if path is not None and os.path.abspath(path) != os.path.abspath(default_path):
            paths.append(path)
    return paths


@pytest.fixture(scope="module")
def pairs(default_model_path, tmp_path_factory):
    """(name, TokenizerFile, transformers tokenizer) per model, over one saved directory."""
    out = []
    for path in _models(default_model_path):
        saved = str(tmp_path_factory.mktemp("tok"))
        Tokenizer.from_gguf(path).hf_tokenizer.save_pretrained(saved)
        from transformers import AutoTokenizer
        out.append((os.path.basename(path), TokenizerFile(saved),
                    AutoTokenizer.from_pretrained(saved, local_files_only=True)))
    return out


def test_same_ids_text_and_special_tokens(pairs):
    for name, light, hf in pairs:
        assert len(light) == len(hf), name
        assert (light.eos_token_id, light.bos_token_id, light.unk_token_id) == (
            hf.eos_token_id, hf.bos_token_id, hf.unk_token_id), name
        assert sorted(light.all_special_ids) == sorted(hf.all_special_ids), name
        for text in TEXTS:
            for special in (True, False):
                ids = light.encode(text, add_special_tokens=special)
                assert ids == hf.encode(text, add_special_tokens=special), (name, text)
                for skip in (True, False):
                    assert light.decode(ids, skip_special_tokens=skip) == hf.decode(
                        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert light.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_same_chat_rendering(pairs):
    rendered = 0
    for name, light, hf in pairs:
        assert light.chat_template == hf.chat_template, name
        if light.chat_template is None:
            continue
        for messages in CONVERSATIONS:
            for prompt in (True, False):
                assert light.apply_chat_template(messages, add_generation_prompt=prompt) == \
                    hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=prompt), name
        rendered += 1
    assert rendered >= 1                      # the default model has a template


def test_cached_gguf_tokenizer_reads_without_transformers(tmp_path, monkeypatch,
                                                          default_model_path):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    fresh = Tokenizer.from_gguf(default_model_path)          # converts (transformers), caches
    cached = Tokenizer.from_gguf(default_model_path)
    assert isinstance(cached._tok, TokenizerFile)
    assert cached.eos_token_ids == fresh.eos_token_ids
    assert cached.render_chat(CONVERSATIONS[1]) == fresh.render_chat(CONVERSATIONS[1])
    assert cached.encode(TEXTS[4]) == fresh.encode(TEXTS[4])
    # the transformers tokenizer is still there for saving beside a model
    assert type(cached.hf_tokenizer).__module__.startswith("transformers")


def _tokenizer_state(path: str) -> dict:
    """Everything ``tokenizers`` holds of a tokenizer.json, as it serialises it back."""
    import json

    from tokenizers import Tokenizer as RustTokenizer
    return json.loads(RustTokenizer.from_file(path).to_str())


def test_compact_tokenizer_json_is_the_same_tokenizer(pairs, tmp_path):
    """The compact form (tokenizer_file.compact_tokenizer_json) of every vocabulary here reads
    back as the very same tokenizer: identical state, ids and text, also through transformers."""
    import shutil

    from transformers import AutoTokenizer

    from kvforge.tokenizer_file import compact_tokenizer_json, is_compact
    for i, (name, light, _) in enumerate(pairs):
        saved = tmp_path / f"saved{i}"
        light_dir = tmp_path / f"compact{i}"
        light._rust.save(str(tmp_path / "plain.json"), pretty=True)
        saved.mkdir()
        shutil.copy(tmp_path / "plain.json", saved / "tokenizer.json")
        shutil.copytree(saved, light_dir)
        path = str(light_dir / "tokenizer.json")
        assert not is_compact(path), name
        assert compact_tokenizer_json(path), name
        assert is_compact(path), name
        assert os.path.getsize(path) < os.path.getsize(saved / "tokenizer.json"), name
        assert _tokenizer_state(path) == _tokenizer_state(str(saved / "tokenizer.json")), name
        compact = TokenizerFile(str(light_dir))
        hf = AutoTokenizer.from_pretrained(str(light_dir), local_files_only=True)
        for text in TEXTS:
            assert compact.encode(text) == light.encode(text), (name, text)
            assert hf.encode(text) == light.encode(text), (name, text)


def test_compact_keeps_merge_pairs_holding_a_space(tmp_path):
    """A merged piece with a space cannot take the "a b" string form: the merges stay pairs."""
    import json

    from kvforge.tokenizer_file import compact_tokenizer_json
    vocab = {"a": 0, "b": 1, " ": 2, "a ": 3, "a b": 4, "ab": 5}
    data = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [["a", " "], ["a ", "b"], ["a", "b"]]}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, indent=2))
    before = _tokenizer_state(str(path))
    assert compact_tokenizer_json(str(path))
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written["model"]["merges"] == [["a", " "], ["a ", "b"], ["a", "b"]]
    assert _tokenizer_state(str(path)) == before


def test_cache_entry_written_indented_is_compacted_on_load(tmp_path, monkeypatch,
                                                           default_model_path):
    """A cache entry in transformers' indented form (written before the compact form) is
    rewritten compact the next time it is read, and reads as the same tokenizer."""
    import json

    from kvforge.tokenizer import _gguf_tokenizer_cache_dir
    from kvforge.tokenizer_file import is_compact
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    fresh = Tokenizer.from_gguf(default_model_path)               # converts and caches
    saved = os.path.join(_gguf_tokenizer_cache_dir(default_model_path), "tokenizer.json")
    assert is_compact(saved)                                       # written compact
    with open(saved, encoding="utf-8") as f:
        data = json.load(f)
    with open(saved, "w", encoding="utf-8") as f:                  # as save_pretrained writes
        json.dump(data, f, indent=2)
    assert not is_compact(saved)
    cached = Tokenizer.from_gguf(default_model_path)
    assert isinstance(cached._tok, TokenizerFile) and is_compact(saved)
    for text in TEXTS:
        assert cached.encode(text) == fresh.encode(text), text
