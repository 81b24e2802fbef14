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
