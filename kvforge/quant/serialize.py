"""Save a weight-only quantized model and load it back without requantizing.

A saved model is a Hugging Face-style directory, so ``load_model_source(dir)`` opens it:

    config.json                   the model's HF config
    tokenizer.json ...            the tokenizer (save_pretrained)
    model.safetensors             HF parameter names; a quantized projection stores its codes:
        <name>.qcodes  [n, Kp/2] uint8  INT4 codes, nibble-packed (packing.pack_int4)
        <name>.scales / <name>.zeros   [n, Kp/G] bf16
        <name>.qweight [n, K] int8 + <name>.scales [n] bf16     INT8 rows
        <name>.weight / <name>.bias    float tensors (norms, embeddings, float layers, biases)
    kvforge_quantization.json     {"format": ..., "method": "int4", "args": {"group_size": 64, ...}}

Fused layers (qkv_proj, gate_up_proj) are split back into their HF shards by rows, so a reload
goes through the model's ordinary loader. The portable INT4 form does not depend on the kernel's
private packing, so a file stays readable if PyTorch changes that layout.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvforge.layers.linear import Linear, MergedLinear, UnquantizedLinearMethod
from kvforge.quant import packing
from kvforge.quant.int4 import Int4Blocks, Int4LinearMethod
from kvforge.quant.int8 import Int8LinearMethod, Int8Rows

QUANT_FILE = "kvforge_quantization.json"
FORMAT = "kvforge-weight-only-v1"
WEIGHTS_FILE = "model.safetensors"
# fused module -> its HF shards in row order (the inverse of the model's stacking)
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def read_saved_quantization(path: str) -> tuple[str, dict] | None:
    """(method name, constructor args) of a saved quantized directory; None if it is not one."""
    f = os.path.join(path, QUANT_FILE)
    if not os.path.isfile(f):
        return None
    with open(f, encoding="utf-8") as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f!r} has format {meta.get('format')!r}; this kvforge reads {FORMAT!r}")
    return meta["method"], dict(meta.get("args", {}))


def _shard_names(prefix: str, layer: Linear) -> list[tuple[str, slice]]:
    """HF names and row ranges of a linear layer's shards."""
    if not isinstance(layer, MergedLinear):
        return [(prefix, slice(0, layer.output_size))]
    parent, _, leaf = prefix.rpartition(".")
    if leaf not in FUSED_SHARDS or len(FUSED_SHARDS[leaf]) != len(layer.output_sizes):
        raise ValueError(f"do not know the checkpoint names of fused layer {prefix!r}")
    out, start = [], 0
    for hf_leaf, size in zip(FUSED_SHARDS[leaf], layer.output_sizes):
        out.append((f"{parent}.{hf_leaf}", slice(start, start + size)))
        start += size
    return out


def quantized_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    tied = getattr(model.config, "tie_word_embeddings", False)
    state: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Linear):
            if prefix == "lm_head" and tied:
                continue   # rebuilt from the embedding on load, exactly as the first time
            method = module.method
            if isinstance(method, Int4LinearMethod):
                blocks = method.export_blocks(module)
            elif isinstance(method, Int8LinearMethod):
                rows = method.export_rows(module)
            elif type(method) is not UnquantizedLinearMethod:
                raise ValueError(f"saving layers quantized with {type(method).__name__} is not "
                                 f"supported (layer {prefix!r})")
            for name, r in _shard_names(prefix, module):
                if isinstance(method, Int4LinearMethod):
                    state[f"{name}.qcodes"] = packing.pack_int4(blocks.codes[r])
                    state[f"{name}.scales"] = blocks.scale[r]
                    state[f"{name}.zeros"] = blocks.zero[r]
                elif isinstance(method, Int8LinearMethod):
                    state[f"{name}.qweight"] = rows.q[r]
                    state[f"{name}.scales"] = rows.scale[r]
                else:
                    state[f"{name}.weight"] = module.weight[r]
                if module.has_bias:
                    state[f"{name}.bias"] = module.bias[r]
        else:
            for p_name, p in module._parameters.items():
                if p is not None:
                    state[f"{prefix}.{p_name}"] = p
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def save_quantized(model: torch.nn.Module, source, out_dir: str) -> str:
    """Write ``model`` (loaded by ``quant.loading.load_model``) to ``out_dir``; returns it."""
    from kvforge.loader import gguf_loader, hf_loader
    qc = getattr(model, "quant_config", None)
    if qc is None:
        raise ValueError("the model is not quantized; load it with a quantization first")
    state = quantized_state_dict(model)
    # INT4 codes are padded to whole groups; the logical input sizes travel in the metadata
    in_features = {p: m.input_size for p, m in model.named_modules()
                   if isinstance(m, Linear) and isinstance(m.method, Int4LinearMethod)}
    in_features = {name: in_features[p] for p, m in model.named_modules() if p in in_features
                   for name, _ in _shard_names(p, m)}
    os.makedirs(out_dir, exist_ok=True)
    if source.format == "gguf":
        reader = source._reader or gguf_loader.open_gguf(source.path)
        hf_config = gguf_loader.gguf_to_hf_config(reader)
    else:
        hf_config = hf_loader.read_hf_config(source.path)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    source.load_tokenizer().hf_tokenizer.save_pretrained(out_dir)
    save_file(state, os.path.join(out_dir, WEIGHTS_FILE),
              metadata={"format": FORMAT, "int4_in_features": json.dumps(in_features)})
    with open(os.path.join(out_dir, QUANT_FILE), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "method": qc.name, "args": qc.describe()}, f, indent=2)
    return out_dir


def iter_saved_weights(path: str) -> Iterator[tuple[str, object]]:
    """(HF name, float tensor | Int4Blocks | Int8Rows) from a saved quantized directory."""
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        in_features = json.loads((f.metadata() or {}).get("int4_in_features", "{}"))
        for key in sorted(f.keys()):
            stem, _, suffix = key.rpartition(".")
            if suffix == "qcodes":
                codes = packing.unpack_int4(f.get_tensor(key))
                scale, zero = f.get_tensor(f"{stem}.scales"), f.get_tensor(f"{stem}.zeros")
                yield f"{stem}.weight", Int4Blocks(codes, scale, zero, in_features[stem])
            elif suffix == "qweight":
                yield f"{stem}.weight", Int8Rows(f.get_tensor(key), f.get_tensor(f"{stem}.scales"))
            elif suffix in ("scales", "zeros"):
                continue   # read with their codes
            else:
                yield key, f.get_tensor(key)

