"""HF directories: config.json + sharded safetensors, read tensor by tensor."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvforge.loader import load_model_source
from kvforge.loader.hf_loader import safetensors_files


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sharded_round_trip(tiny_model_factory, kind):
    model_dir, model = tiny_model_factory(kind)
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors.index.json"))
    assert len(safetensors_files(model_dir)) > 1          # really sharded

    src = load_model_source(model_dir)
    assert src.format == "hf"
    hf = model.config
    c = src.config
    assert c.architecture == type(model).__name__
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert c.tie_word_embeddings == hf.tie_word_embeddings

    loaded = dict(src.iter_weights())
    expected = {k: v for k, v in model.state_dict().items()
                if not (hf.tie_word_embeddings and k == "lm_head.weight")}
    assert set(loaded) == set(expected)
    for name, t in expected.items():
        assert torch.equal(loaded[name], t), name


def test_single_file_and_missing_shard(tiny_model_factory, tmp_path):
    _, model = tiny_model_factory("llama")
    single = tmp_path / "single"
    model.save_pretrained(single)                           # default shard size: one file
    assert safetensors_files(str(single)) == [str(single / "model.safetensors")]
    loaded = dict(load_model_source(str(single)).iter_weights())
    assert torch.equal(loaded["model.norm.weight"], model.state_dict()["model.norm.weight"])

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="2MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    os.remove(sharded / victim)
    with pytest.raises(FileNotFoundError, match=victim):
        load_model_source(str(sharded)).iter_weights().__next__()


def test_tokenizer_from_hf_dir(tiny_model_factory):
    model_dir, _ = tiny_model_factory("llama")
    tok = load_model_source(model_dir).load_tokenizer()
    assert tok.encode("Hello") == [19556]
    assert 2 in tok.eos_token_ids
