"""Read a GGUF file (llama.cpp's format) as a Hugging Face config dict plus HF-named tensors.

Four translations happen here, so that the rest of kvforge only ever sees HF vocabulary:
  1. metadata keys  ``llama.attention.head_count`` -> ``num_attention_heads`` ...
  2. tensor names   ``blk.3.attn_q.weight``        -> ``model.layers.3.self_attn.q_proj.weight``
     (per architecture where llama.cpp reuses a name: Gemma's ``ffn_norm`` is the norm before
     the MLP, not the one after attention)
  3. tensor layout  ggml shape [ne0, ne1] is torch shape [ne1, ne0], and llama.cpp's convert
     script permuted the rows of q_proj / k_proj for its rotary layout; we permute them back.
  4. tensor values  llama.cpp stores Gemma's norm weights as ``1 + w`` (its RMSNorm multiplies
     by the weight); HF keeps ``w`` and scales by ``1 + w``, so we subtract the 1 again.

The file is memory-mapped by ``gguf_file.GGUFFile`` (metadata decoded lazily); tensors are
dequantized one at a time.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any, Iterator

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvforge.loader.gguf_file import GGUFFile

# GGUF architecture name -> (HF architecture class, HF model_type)
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# a llama-architecture file with experts is Mixtral (llama.cpp writes Mixtral as "llama")
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# llama.cpp's convert_hf_to_gguf permutes q/k rows only for these (they use its "normal" rope;
# qwen2 uses the NEOX rope layout and is stored unpermuted).
_PERMUTED_QK_ARCHS = frozenset({"llama", "mistral"})

# per-layer GGUF tensor stem -> HF module path inside model.layers.N
_LAYER_TENSORS: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # mixture of experts: the router, every expert stacked in one 3-D tensor [E, out, in]
    # (split per expert by split_experts), Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# an expert tensor's HF name before split_experts: model.layers.N.mlp.experts.<proj>.weight
_STACKED_EXPERTS = re.compile(r"^(?P<moe>.+\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)"
                              r"\.weight$")
# architectures whose stems differ from (or add to) the table above
_ARCH_LAYER_TENSORS: dict[str, dict[str, str]] = {
    "gemma3": {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# llama.cpp's convert_hf_to_gguf adds 1 to every ``*norm.weight`` of these (Gemma's norm_shift)
_NORM_SHIFTED_ARCHS = frozenset({"gemma3"})
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# types the default model and our tests exercise; gguf.quants handles others (K-quants, ...)
# too, and a type it cannot dequantize fails loudly, naming the tensor
TESTED_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"})


def open_gguf(path: str) -> GGUFFile:
    """Open (memory-map) a GGUF file; anything malformed becomes a ValueError naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    try:
        reader = GGUFFile(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors, ...
        raise ValueError(f"{path!r} is not a valid GGUF file: {type(e).__name__}: {e}") from e
    # A file truncated after its header parses fine: numpy's memmap slicing silently returns
    # short arrays for the missing tensor data. Check every tensor lies inside the file.
    file_size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{path!r} is truncated or corrupt: tensor {t.name!r} needs bytes "
                             f"[{t.data_offset}, {t.data_offset + t.n_bytes}) but the file has "
                             f"{file_size}")
    return reader


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_architecture(reader: GGUFFile) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{sorted(_ARCHITECTURES)}")
    return arch


def gguf_to_hf_config(reader: GGUFFile) -> dict[str, Any]:
    """Translate GGUF metadata into the dict a HF config.json would hold."""
    arch = gguf_architecture(reader)
    hf_arch, model_type = _ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    # head_count_kv may be absent (then MHA) or, in some files, a per-layer array
    n_kv = key("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        n_kv = n_kv[0]
    vocab = key("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF has neither a vocab_size key nor a token list")
        vocab = len(tokens)          # the array length, not decoded
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // n_heads

    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "hidden_act": "silu",
        # output.weight absent means the head reuses the embedding matrix
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in reader.tensors),
    }
    rope_type = key("rope.scaling.type")
    if rope_type is not None and rope_type != "none":
        scaling: dict[str, Any] = {"rope_type": rope_type, "type": rope_type}
        if key("rope.scaling.factor") is not None:
            scaling["factor"] = float(key("rope.scaling.factor"))
        if key("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = int(
                key("rope.scaling.original_context_length"))
        if key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(key("rope.scaling.attn_factor"))
        config["rope_scaling"] = scaling
    if key("attention.sliding_window") is not None:
        config["sliding_window"] = int(key("attention.sliding_window"))
    if arch == "gemma3":
        config.update(_gemma3_config(key, config))
    if key("expert_count"):
        config.update(_moe_config(arch, key))
    for gguf_key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def _moe_config(arch: str, key) -> dict[str, Any]:
    """The expert keys of a mixture-of-experts file. llama.cpp routes Qwen2-MoE without
    renormalising the top-k weights (HF: norm_topk_prob false) and Mixtral with it."""
    experts, used = int(key("expert_count")), int(key("expert_used_count", 0))
    if arch == "qwen2moe":
        return {"num_experts": experts, "num_experts_per_tok": used,
                "moe_intermediate_size": int(key("expert_feed_forward_length", 0)),
                "shared_expert_intermediate_size":
                    int(key("expert_shared_feed_forward_length", 0)),
                "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "llama":
        hf_arch, model_type = _MIXTRAL
        return {"architectures": [hf_arch], "model_type": model_type,
                "num_local_experts": experts, "num_experts_per_tok": used}
    raise ValueError(f"GGUF architecture {arch!r} with {experts} experts is not supported "
                     f"(mixture-of-experts files: qwen2moe, llama/Mixtral)")


def split_experts(name: str, tensor) -> Iterator[tuple[str, Any]]:
    """One stacked expert tensor ``...mlp.experts.gate_proj.weight`` [E, out, in] as E per-expert
    ``...mlp.experts.e.gate_proj.weight`` [out, in] (views); any other tensor as it is.
    ``tensor`` is anything indexable along its first dimension (a tensor, raw block rows)."""
    m = _STACKED_EXPERTS.match(name)
    if m is None:
        yield name, tensor
        return
    for e in range(tensor.shape[0]):
        yield f"{m['moe']}.{e}.{m['proj']}.weight", tensor[e]


def _gemma3_config(key, config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 config.json holds beyond the common keys. llama.cpp writes the global
    RoPE base and the window but hard-codes the rest; we use its values (= HF's defaults)."""
    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    extras: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": 10000.0,
        # llama.cpp: the 27B model (62 layers) scales queries by hidden / heads, others by
        # head_dim (HF: query_pre_attn_scalar 168 and 256)
        "query_pre_attn_scalar": (hidden // config["num_attention_heads"] if n_layers == 62
                                  else config["head_dim"]),
    }
    pattern = key("attention.sliding_window_pattern")
    if not config.get("sliding_window"):    # llama.cpp: no window, every layer global
        extras["layer_types"] = ["full_attention"] * n_layers
    elif isinstance(pattern, list):           # per layer, True = sliding window
        extras["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:               # a period: the last layer of each is global
        extras["sliding_window_pattern"] = int(pattern)
    if key("final_logit_softcapping") is not None:
        extras["final_logit_softcapping"] = float(key("final_logit_softcapping"))
    if key("attn_logit_softcapping") is not None:
        extras["attn_logit_softcapping"] = float(key("attn_logit_softcapping"))
    return extras


def hf_tensor_name(gguf_name: str, arch: str | None = None) -> str | None:
    """``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight``; None if unknown
    (e.g. llama.cpp's precomputed ``rope_freqs.weight``, which HF recomputes from the config).
    ``arch`` (the GGUF architecture) selects its own stems where llama.cpp's differ."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.match(gguf_name)
    if m is None:
        return None
    layer, stem, kind = m.groups()
    module = _ARCH_LAYER_TENSORS.get(arch, {}).get(stem) or _LAYER_TENSORS.get(stem)
    return None if module is None else f"model.layers.{layer}.{module}.{kind}"


def to_hf_values(arch: str, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A dequantized tensor's values in HF's convention: Gemma's norm weights minus the 1 that
    llama.cpp added (in fp32: a half-precision norm would round the shift); Qwen2-MoE's shared
    expert gate back to its [1, H] shape."""
    if arch in _NORM_SHIFTED_ARCHS and hf_name.endswith("norm.weight"):
        return tensor.float() - 1.0
    if hf_name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
        return tensor.unsqueeze(0)          # llama.cpp stores Qwen2-MoE's [1, H] as a vector
    return tensor


def unpermute_qk_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q_proj/k_proj weight or bias.

    Inside each head (head_dim = 2 * half rows), HF keeps the rotary pairs as the two halves
    (rotate_half: row i pairs with row i + half); llama.cpp interleaves them (row 2i with 2i+1):

        HF row order per head      [x0 x1 .. x(h-1) | y0 y1 .. y(h-1)]   viewed as (2, half)
        llama.cpp row order        [x0 y0 x1 y1 .. x(h-1) y(h-1)]       viewed as (half, 2)

    convert_hf_to_gguf did reshape(n_head, 2, half) -> swap -> (n_head, half, 2); we read the
    rows as (n_head, half, 2) and swap back to (n_head, 2, half).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads (needs a multiple "
                         f"of {2 * n_head})")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _torch_shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    # ggml lists dimensions fastest-first: ggml [ne0, ne1] == torch [ne1, ne0]
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def tensor_to_torch(t: gguf.ReaderTensor) -> torch.Tensor:
    """Dequantize one GGUF tensor to its logical torch shape.

    F16 / BF16 keep their dtype (the model casts); everything else becomes float32.
    """
    type_name = t.tensor_type.name
    shape = _torch_shape(t)
    if type_name == "F16":
        return torch.from_numpy(np.array(t.data, dtype=np.float16)).reshape(shape)
    if type_name == "BF16":
        raw = np.array(t.data, dtype=np.uint8).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    if type_name == "F32":
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(shape)
    try:
        values = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {t.name!r} has GGML type {type_name}, which gguf cannot "
                         f"dequantize: {e}") from e
    return torch.from_numpy(values).reshape(shape)


def qk_permuted_heads(arch: str, hf_name: str, config: dict[str, Any]) -> int | None:
    """The head count to undo llama.cpp's rotary row permutation of ``hf_name`` with
    (``unpermute_qk_rows``), or None where the file stores the rows in HF order."""
    if arch not in _PERMUTED_QK_ARCHS:
        return None
    if ".self_attn.q_proj." in hf_name:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf_name:
        return config["num_key_value_heads"]
    return None


def iter_gguf_weights(reader: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) one at a time, q/k rows back in HF order."""
    arch = gguf_architecture(reader)
    config = gguf_to_hf_config(reader)
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        tensor = to_hf_values(arch, name, tensor_to_torch(t))
        n_head = qk_permuted_heads(arch, name, config)
        if n_head is not None:
            tensor = unpermute_qk_rows(tensor, n_head)
        yield from split_experts(name, tensor)


RawTensor = tuple[str, str, tuple[int, ...], np.ndarray]   # HF name, ggml type, shape, bytes


def iter_raw_tensors(path: str | GGUFFile) -> Iterator[RawTensor]:
    """Yield (HF name, ggml type name, logical torch shape, raw bytes as uint8) per tensor.

    For quantization work that wants the file's blocks as they are. Note q_proj/k_proj rows are
    still in llama.cpp's permuted order here (permuting quantized rows is a row gather, so a
    consumer can apply ``unpermute_qk_rows`` to the (rows, bytes_per_row) array), and Gemma's
    norm weights still hold llama.cpp's ``1 + w`` (``to_hf_values`` converts them).
    """
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        yield name, t.tensor_type.name, _torch_shape(t), raw


def raw_rows(t: gguf.ReaderTensor) -> torch.Tensor:
    """A 2-D tensor's bytes as uint8 [rows, row_bytes] in the file's own encoding, over the
    reader's memory map: no copy, no dequantization (the pages are read when first used); a 3-D
    tensor (stacked experts) as [E, rows, row_bytes].

    The map is read-only; torch warns that it cannot protect such memory from writes, and nothing
    here writes to it, so that warning is silenced.
    """
    shape = _torch_shape(t)
    if len(shape) not in (2, 3):
        raise ValueError(f"tensor {t.name!r} has shape {shape}; raw rows need a 2-D tensor "
                         f"(or 3-D stacked experts)")
    raw = np.asarray(t.data).view(np.uint8).reshape(*shape[:-1], -1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def gguf_chat_template(reader: GGUFFile) -> str | None:
    return _field(reader, "tokenizer.chat_template")


__all__ = ["GGMLQuantizationType", "open_gguf", "gguf_to_hf_config", "hf_tensor_name",
           "to_hf_values", "unpermute_qk_rows", "tensor_to_torch", "iter_gguf_weights",
           "iter_raw_tensors", "raw_rows", "split_experts",
           "gguf_chat_template", "TESTED_TYPES"]
