"""Write tiny GGUF files the way llama.cpp's convert script would, from HF-named tensors."""
from __future__ import annotations

from typing import Callable

import gguf
import numpy as np
import torch

# HF name stem -> GGUF name stem (the reverse of what the loader maps; spelled out separately
# so the test does not reuse the code under test)
_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}

TINY = dict(vocab=40, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2)


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")          # model.layers.N.<module...>.weight
    module, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to q/k rows (the formula from its LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def tiny_hf_state(seed: int = 0, *, lm_head: bool = False, bias: bool = False,
                  vocab: int = TINY["vocab"], dims: dict | None = None) -> dict[str, torch.Tensor]:
    """dims: sizes other than TINY's (e.g. K-quants need 256-wide rows)."""
    d = dims or TINY
    g = torch.Generator().manual_seed(seed)
    h, f, hd = d["hidden"], d["ffn"], d["hidden"] // d["heads"]
    kv = d["kv_heads"] * hd
    state = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
                  "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                  "mlp.down_proj.weight": (h, f), "input_layernorm.weight": (h,),
                  "post_attention_layernorm.weight": (h,)}
        if bias:
            shapes.update({"self_attn.q_proj.bias": (h,), "self_attn.k_proj.bias": (kv,),
                           "self_attn.v_proj.bias": (kv,)})
        for name, shape in shapes.items():
            state[p + name] = torch.randn(*shape, generator=g)
    state["model.norm.weight"] = torch.randn(h, generator=g)
    if lm_head:
        state["lm_head.weight"] = torch.randn(vocab, h, generator=g)
    return state


def write_gguf(path: str, state: dict[str, torch.Tensor], *, arch: str = "llama",
               encode: Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]
               | None = None, permute: bool = True, extra: Callable | None = None,
               dims: dict | None = None) -> None:
    """Write ``state`` (HF names, float32) as a GGUF file.

    encode(hf_name, array) -> (stored array, ggml type) picks each tensor's storage; default F32.
    """
    d = dims or TINY
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["ffn"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(state["model.embed_tokens.weight"].shape[0])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra is not None:
        extra(w)
    for name, t in state.items():
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_cpp_permute(t, d["heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_cpp_permute(t, d["kv_heads"])
        arr = t.numpy().astype(np.float32)
        if encode is None:
            w.add_tensor(gguf_name(name), arr)
        else:
            stored, qtype = encode(name, arr)
            w.add_tensor(gguf_name(name), stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------- whole HF models, as convert_hf_to_gguf
# per-architecture stems where llama.cpp's names differ from the Llama table above
_TO_GGUF_BY_ARCH = {
    "gemma3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "llama": {"mlp.gate": "ffn_gate_inp"},            # Mixtral's router
    "qwen2moe": {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                 "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                 "mlp.shared_expert.up_proj": "ffn_up_shexp",
                 "mlp.shared_expert.down_proj": "ffn_down_shexp"},
}


def _hf_tensors_as_gguf(arch: str, name: str, t: torch.Tensor):
    """(GGUF name, tensor) pairs of one HF tensor: transformers-5 stacked experts
    ``mlp.experts.gate_up_proj`` [E, 2I, H] become llama.cpp's ``ffn_gate_exps`` and
    ``ffn_up_exps`` [E, I, H], ``mlp.experts.down_proj`` its ``ffn_down_exps``."""
    parts = name.split(".")
    if name.endswith(".mlp.experts.gate_up_proj"):
        half = t.shape[1] // 2
        return [(f"blk.{parts[2]}.ffn_gate_exps.weight", t[:, :half]),
                (f"blk.{parts[2]}.ffn_up_exps.weight", t[:, half:])]
    if name.endswith(".mlp.experts.down_proj"):
        return [(f"blk.{parts[2]}.ffn_down_exps.weight", t)]
    if name.endswith(".mlp.shared_expert_gate.weight"):      # llama.cpp: a vector [H]
        return [(gguf_name_for(arch, name), t.reshape(-1))]
    return [(gguf_name_for(arch, name), t)]


def gguf_name_for(arch: str, hf_name: str) -> str:
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers."):
        stem = _TO_GGUF_BY_ARCH.get(arch, {}).get(".".join(parts[3:-1]))
        if stem is not None:
            return f"blk.{parts[2]}.{stem}.{parts[-1]}"
    return gguf_name(hf_name)


def _rope_theta(config, layer_type: str = "full_attention") -> float:
    params = getattr(config, "rope_parameters", None) or {}
    params = params.get(layer_type, params)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def write_hf_model_gguf(path: str, hf_model, arch: str,
                        tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
                        extra: Callable[[gguf.GGUFWriter], None] | None = None,
                        encode: Callable[[str, np.ndarray],
                                         tuple[np.ndarray, gguf.GGMLQuantizationType]]
                        | None = None) -> None:
    """Write a transformers model as llama.cpp's ``convert_hf_to_gguf`` would, in F32 (norms in
    F32 as it keeps them): ``llama`` permutes q/k rows for its rotary layout, ``qwen2`` keeps
    them (NEOX rope), ``gemma3`` stores every ``*norm.weight`` as ``1 + w`` and writes
    key/value lengths and the sliding window but not the local RoPE base. An untied head is
    ``output.weight``; a tied one is left out. ``tokenizer(writer)`` adds the vocabulary,
    ``extra(writer)`` any further metadata; ``encode(gguf_name, array)`` -> (stored array, ggml
    type) picks a tensor's storage (default F32). ``qwen2moe`` writes the expert keys and
    stacked expert tensors."""
    c = hf_model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama" and getattr(c, "num_local_experts", None):      # Mixtral
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen2moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "gemma3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        if c.sliding_window is not None:
            w.add_sliding_window(c.sliding_window)
    if tokenizer is not None:
        tokenizer(w)
    else:
        w.add_vocab_size(c.vocab_size)
    if extra is not None:
        extra(w)
    tied = getattr(c, "tie_word_embeddings", False)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        t = t.detach().float()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = llama_cpp_permute(t, c.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        for stored_name, part in _hf_tensors_as_gguf(arch, name, t):
            arr = part.contiguous().numpy().astype(np.float32)
            if encode is None:
                w.add_tensor(stored_name, arr)
            else:
                stored, qtype = encode(stored_name, arr)
                w.add_tensor(stored_name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gpt2_bpe_tokenizer(hf_tokenizer, pre: str, chat_template: str | None = None,
                       eos_token: str | None = None) -> Callable[[gguf.GGUFWriter], None]:
    """A byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``) from a transformers fast
    tokenizer, as llama.cpp writes Qwen2's: tokens, types (3 = control for special tokens),
    merges, the pre-tokenizer name, special ids and the chat template."""
    import json
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {a["content"]: a["id"] for a in spec["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = special[eos_token] if eos_token is not None else hf_tokenizer.eos_token_id

    def add(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_eos_token_id(eos)
        w.add_bos_token_id(hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None
                           else eos)
        w.add_add_bos_token(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)

    return add


# A SentencePiece-style vocabulary like Gemma's (tokenizer.ggml.model = llama): specials, then
# pieces ("\u2581" marks a word start), scored best-first. Gemma's 256 byte-fallback tokens are
# left out: a random model emits them in any order, and transformers' byte-fallback decoding of
# such runs is not prefix-stable (<0x6C> alone is "l", followed by <0xFF> both become U+FFFD),
# which the engine's incremental detokenizer refuses.
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_GEMMA_WORDS = ["hello", "world", "the", "model", "user", "turn", "gemma", "he", "ll", "wor",
                "ld", "mo", "del", "us", "er", "tu", "rn", "ge", "mma"]


def gemma_vocabulary() -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = (["\u2581"] + letters + [f"\u2581{x}" for x in letters]
              + [f"\u2581{w}" for w in _GEMMA_WORDS] + _GEMMA_WORDS)
    return GEMMA_SPECIALS + list(dict.fromkeys(pieces))


def sentencepiece_tokenizer(chat_template: str | None = None) -> Callable[[gguf.GGUFWriter], None]:
    tokens = gemma_vocabulary()
    n_special = len(GEMMA_SPECIALS)
    # token types: 1 normal, 2 unknown, 3 control (llama.cpp's llama_token_type)
    types = [3, 3, 3, 2, 3, 3] + [1] * (len(tokens) - n_special)
    # scores fall with position, like SentencePiece's
    scores = [0.0] * n_special + [-float(i) for i in range(len(tokens) - n_special)]

    def add(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        if chat_template is not None:
            w.add_chat_template(chat_template)

    return add
