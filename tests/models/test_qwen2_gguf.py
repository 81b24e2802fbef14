"""Qwen2 from a GGUF file written as llama.cpp writes Qwen2 (q/k/v biases, untied
``output.weight``, RoPE base 1e6, a byte-level BPE vocabulary with the qwen2 pre-tokenizer and
a ChatML template in the metadata), against HF transformers. (Qwen2 from an HF directory:
tests/engine/test_hf_equivalence.py and tests/models/test_llama.py.)"""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from kvforge.loader import load_model_source
from tests.helpers.engine_vs_hf import check_engine_matches_hf
from tests.helpers.hf_oracle import TINY_BASE, load_hf_gguf
from tests.loader.gguf_factory import gpt2_bpe_tokenizer, write_hf_model_gguf

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory, tokenizer_dir):
    """(HF Qwen2 model, its GGUF path); the vocabulary is SmolLM2's (ChatML tokens included)."""
    torch.manual_seed(0)
    config = tf.Qwen2Config(**{**TINY_BASE, "tie_word_embeddings": False,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    hf = tf.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):        # HF starts them at zero: make them matter
                p.normal_(0, 0.5)
    tokenizer = tf.AutoTokenizer.from_pretrained(tokenizer_dir)
    path = str(tmp_path_factory.mktemp("qwen2_gguf") / "tiny-qwen2.gguf")
    write_hf_model_gguf(path, hf, "qwen2", tokenizer=gpt2_bpe_tokenizer(
        tokenizer, pre="qwen2", chat_template=CHATML, eos_token="<|im_end|>"))
    return hf, path


def test_config_and_weights_from_qwen2_metadata(qwen_gguf):
    hf, path = qwen_gguf
    source = load_model_source(path)
    c = source.config
    assert c.architecture == "Qwen2ForCausalLM" and c.rope_theta == 1e6
    assert c.attention_bias and not c.tie_word_embeddings and c.sliding_window is None
    weights = dict(source.iter_weights())
    state = hf.state_dict()
    assert set(weights) == set(state)                     # lm_head.weight from output.weight
    for name in ("lm_head.weight", "model.layers.1.self_attn.k_proj.bias",
                 "model.layers.0.self_attn.q_proj.weight"):
        torch.testing.assert_close(weights[name], state[name], rtol=0, atol=0)


def test_factory_gguf_reads_back_in_transformers(qwen_gguf):
    hf, path = qwen_gguf
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(load_hf_gguf(path)(ids).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_engine_greedy_matches_hf(qwen_gguf):
    hf, path = qwen_gguf
    check_engine_matches_hf(path, hf, "qwen2-gguf")


def test_tokenizer_chatml_and_qwen2_pretokenizer(qwen_gguf):
    _, path = qwen_gguf
    tok = load_model_source(path).load_tokenizer()
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"] and tok.decode(ids) == "user\nhi\nassistant\n"
    im_end = tok.convert_ids_to_tokens([tok.eos_token_ids[0]])
    assert im_end == ["<|im_end|>"]                   # tokenizer.ggml.eos_token_id
    # qwen2's pre-tokenizer splits numbers into single digits (gpt2's keeps runs together)
    pieces = tok.convert_ids_to_tokens(tok.encode("x = 12345", add_special_tokens=False))
    assert pieces[-5:] == ["1", "2", "3", "4", "5"]
    assert tok.bos_token_id is not None and tok.encode("hi")[0] != tok.bos_token_id
