"""Save a weight-only quantized model and load it back without requantizing.

A saved model is a Hugging Face-style directory, so ``load_model_source(dir)`` opens it:

    config.json                   the model's HF config
    tokenizer.json ...            the tokenizer (save_pretrained)
    model.safetensors             HF parameter names; a quantized projection stores its codes:
        <name>.qcodes  [n, Kp/2] uint8  INT4 codes, nibble-packed (packing.pack_int4)
        <name>.scales / <name>.zeros   [n, Kp/G] bf16
        <name>.qweight [n, K] int8 + <name>.scales [n] bf16 (int8) / fp32 (W8A8)   INT8 rows
        <name>.input_scales [K]        calibrated methods (awq, smoothquant): the layer computes
                                       (x / s) Q(W s)^T; the rows above hold Q(W s)
        <name>.weight / <name>.bias    float tensors (norms, embeddings, float layers, biases)
    kvforge_quantization.json     {"format": ..., "method": "int4", "args": {"group_size": 64, ...}}

Every method whose layers can be saved has ``export_rows(layer)`` (Int4Blocks / Int8Rows, or
``InputScaledRows`` for calibrated ones) and takes the same objects back in ``load_weight``,
so a reload installs the saved codes and scales as they are: no requantization, no
calibration (AWQ's scale and clip search, SmoothQuant's statistics).

Fused layers (qkv_proj, gate_up_proj) are split back into their HF shards by rows, and MoE
experts into per-expert ``<experts>.<e>.{gate,up,down}_proj`` shards, so a reload goes through
the model's ordinary loader. The portable INT4 form does not depend on the kernel's
private packing, so a file stays readable if PyTorch changes that layout.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvforge.attention.mla import MLAUpProjection
from kvforge.layers.linear import (Linear, MergedLinear, PackedRowsEmbedding,
                                   UnquantizedLinearMethod, dense_weight)
from kvforge.layers.moe import EXPERT_SHARDS, FusedMoE, UnquantizedExpertsMethod
from kvforge.quant import packing
from kvforge.quant.calibration import CalibratedLinearMethod, InputScaledRows
from kvforge.quant.int4 import Int4Blocks
from kvforge.quant.int8 import Int8Rows
from kvforge.quant.lowrank import LoRCRows
from kvforge.quant.row_formats import read_registered_rows, registered_companions

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


def export_layer(prefix: str, layer: Linear):
    """A layer's saved form: None (float), Int4Blocks, Int8Rows or InputScaledRows."""
    method = layer.method
    if type(method) is UnquantizedLinearMethod:
        return None
    if isinstance(method, CalibratedLinearMethod):
        if not method.quantized:
            raise ValueError(f"layer {prefix!r} is not calibrated yet; nothing to save")
        return InputScaledRows(method.export_rows(layer), method.scales)
    if not hasattr(method, "export_rows"):
        raise ValueError(f"saving layers quantized with {type(method).__name__} is not "
                         f"supported (layer {prefix!r})")
    return method.export_rows(layer)


def _rows_tensors(name: str, saved, rows: slice) -> dict[str, torch.Tensor]:
    if isinstance(saved, InputScaledRows):      # one input: every shard carries the same s
        return {**_rows_tensors(name, saved.rows, rows), f"{name}.input_scales": saved.input_scale}
    if isinstance(saved, LoRCRows):             # each shard its own low-rank factors
        return {**_rows_tensors(name, saved.rows, rows), **saved.factor_tensors(name, rows)}
    if hasattr(saved, "saved_tensors"):         # formats registered in row_formats.py
        return saved.saved_tensors(name, rows)
    if isinstance(saved, Int4Blocks):
        return {f"{name}.qcodes": packing.pack_int4(saved.codes[rows]),
                f"{name}.scales": saved.scale[rows], f"{name}.zeros": saved.zero[rows]}
    if isinstance(saved, Int8Rows):
        return {f"{name}.qweight": saved.q[rows], f"{name}.scales": saved.scale[rows]}
    raise ValueError(f"cannot save {type(saved).__name__} for {name!r}")


def _int4_blocks(saved) -> Int4Blocks | None:
    while isinstance(saved, (InputScaledRows, LoRCRows)):
        saved = saved.rows
    return saved if isinstance(saved, Int4Blocks) else None


def quantized_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(tensors by saved name, logical input size of every INT4 shard: codes are padded)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    state: dict[str, torch.Tensor] = {}
    int4_in_features: dict[str, int] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Linear):
            if prefix == "lm_head" and tied:
                continue   # rebuilt from the embedding on load, exactly as the first time
            saved = export_layer(prefix, module)
            for name, r in _shard_names(prefix, module):
                if saved is None:
                    state[f"{name}.weight"] = dense_weight(module)[r]
                else:
                    state.update(_rows_tensors(name, saved, r))
                    if _int4_blocks(saved) is not None:
                        int4_in_features[name] = module.input_size
                if module.has_bias:
                    state[f"{name}.bias"] = module.bias[r]
        elif isinstance(module, FusedMoE):
            state.update(_experts_tensors(prefix, module, int4_in_features))
        elif isinstance(module, PackedRowsEmbedding):    # a tied head's packed table
            state[f"{prefix}.weight"] = module.weight
        elif isinstance(module, MLAUpProjection):    # back to HF's kv_b_proj [H * (P + V), L]
            state[f"{prefix}.weight"] = torch.cat([module.w_uk, module.w_uv], dim=1).reshape(
                -1, module.kv_lora_rank)
        else:
            for p_name, p in module._parameters.items():
                if p is not None:
                    state[f"{prefix}.{p_name}"] = p
    return {k: v.detach().contiguous().clone() for k, v in state.items()}, int4_in_features


def _experts_tensors(prefix: str, moe: FusedMoE, int4_in_features: dict[str, int]
                     ) -> dict[str, torch.Tensor]:
    """A FusedMoE as HF per-expert shards ``<prefix>.<e>.{gate,up,down}_proj``, the names every
    MoE family's loader routes to ``load_expert_weight`` (stacked float or quantized rows)."""
    export = getattr(moe.method, "export_expert", None)
    if export is None and type(moe.method) is not UnquantizedExpertsMethod:
        raise ValueError(f"saving experts stored by {type(moe.method).__name__} is not supported "
                         f"(layer {prefix!r})")
    i, out = moe.intermediate_size, {}
    for e in range(moe.num_experts):
        for shard in EXPERT_SHARDS:
            name = f"{prefix}.{e}.{shard}_proj"
            if export is None:
                rows = moe.w2[e] if shard == "down" else moe.w13[e, :i] if shard == "gate" \
                    else moe.w13[e, i:]
                out[f"{name}.weight"] = rows
                continue
            saved = export(moe, e, shard)
            out.update(_rows_tensors(name, saved, slice(None)))
            if isinstance(saved, Int4Blocks):
                int4_in_features[name] = saved.in_features
    return out


def save_quantized(model: torch.nn.Module, source, out_dir: str) -> str:
    """Write ``model`` (loaded by ``quant.loading.load_model``) to ``out_dir``; returns it."""
    from kvforge.loader import gguf_loader, hf_loader
    qc = getattr(model, "quant_config", None)
    if qc is None:
        raise ValueError("the model is not quantized; load it with a quantization first")
    pending = qc.pending_layers() if hasattr(qc, "pending_layers") else []
    if pending:
        raise ValueError(f"{qc.name} layers were never calibrated, e.g. {pending[0]!r}")
    # INT4 codes are padded to whole groups; the logical input sizes travel in the metadata
    state, in_features = quantized_state_dict(model)
    os.makedirs(out_dir, exist_ok=True)
    if source.format == "gguf":
        hf_config = gguf_loader.gguf_to_hf_config(source.gguf_reader())
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
    """(HF name, float tensor | Int4Blocks | Int8Rows | a registered format, possibly wrapped
    in InputScaledRows / LoRCRows) from a saved quantized directory."""
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        in_features = json.loads((f.metadata() or {}).get("int4_in_features", "{}"))
        keys = set(f.keys())
        skipped = {"scales", "zeros", "input_scales", "lorc_u", "lorc_v"} | registered_companions()
        for key in sorted(keys):
            stem, _, suffix = key.rpartition(".")
            registered = read_registered_rows(suffix, f.get_tensor, stem)
            if registered is not None:
                rows = registered
            elif suffix == "qcodes":
                codes = packing.unpack_int4(f.get_tensor(key))
                scale, zero = f.get_tensor(f"{stem}.scales"), f.get_tensor(f"{stem}.zeros")
                rows = Int4Blocks(codes, scale, zero, in_features[stem])
            elif suffix == "qweight":
                rows = Int8Rows(f.get_tensor(key), f.get_tensor(f"{stem}.scales"))
            elif suffix in skipped:
                continue   # read with their codes
            else:
                yield key, f.get_tensor(key)
                continue
            if f"{stem}.lorc_u" in keys:
                rows = LoRCRows(rows, f.get_tensor(f"{stem}.lorc_u"), f.get_tensor(f"{stem}.lorc_v"))
            if f"{stem}.input_scales" in keys:
                rows = InputScaledRows(rows, f.get_tensor(f"{stem}.input_scales"))
            yield f"{stem}.weight", rows

