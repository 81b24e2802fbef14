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
