"""GGUF weights run in the file's own block formats (``--quantization gguf``).

Every projection, the LM head and the token embedding keep the file's bytes: a uint8
[rows, row_bytes] tensor over ``GGUFReader``'s memory map (``gguf_loader.raw_rows``), never
dequantized at load. The compiled kernels (``kernels/csrc/gguf_blocks.cpp``,
docs/gguf_native.md) multiply them directly by 8-bit integer dot products (prefill chunks in
passes of 64 activation rows; float shards with more rows as fp32 tiles + GEMM, and block
shards from the measured ``kernels/gguf_tiles.gemm_min_rows`` on as int8 panels or fp32 tiles,
whichever the machine runs faster); an embedding lookup
dequantizes only the rows it looks up. ``--quantization none`` dequantizes everything to fp32
at load and is the reference.

    file tensor (mmap)                      layer
    blk.N.attn_q / attn_k / attn_v   ->  qkv_proj: three shards, one raw tensor each
    blk.N.ffn_gate / ffn_up          ->  gate_up_proj: two shards
    blk.N.ffn_{gate,up,down}_exps    ->  each expert's rows of the stacked tensor (gguf_experts.py)
    token_embd (tied: also the head) ->  GGUFEmbedding + lm_head, one raw tensor for both

Shards keep their own type (Q4_K_M files mix Q4_K and Q6_K inside a layer). q_proj / k_proj
rows of Llama-family files are stored in llama.cpp's rotary order; a permutation of whole rows
is exact on blocks too, so those two tensors are gathered into RAM in HF order (the only copy).
Types: ``NATIVE_TYPES``; a projection of another type (Q2_K, Q3_K, IQ*) is an error naming the
tensor (``--quantization none`` still runs it, dequantized).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from kvforge.kernels import cpu_kernels
from kvforge.kernels.gguf_tiles import shard_gemm_path
from kvforge.layers.linear import Linear, LinearMethod
from kvforge.layers.prompt_rows import computing_prompt_rows
from kvforge.loader import gguf_loader
from kvforge.quant.base import QuantizationConfig, load_bias_shard, register_quantization

# a layer's block shards are buffers named GGUF_BLOCKS_BUFFER + shard index (views of the
# mapped file; never saved)
GGUF_BLOCKS_BUFFER = "gguf_raw_"


def blocks_buffer_name(shard: int) -> str:
    """The name of a layer's buffer holding block shard ``shard``."""
    return f"{GGUF_BLOCKS_BUFFER}{shard}"


def gguf_block_buffers(module: nn.Module, recurse: bool = False) -> list[torch.Tensor]:
    """The GGUF block shards ``module`` holds (with ``recurse``, its submodules' too: a shard
    two modules share, as a tied head and embedding do, once); none for other modules."""
    return [b for name, b in module.named_buffers(recurse=recurse)
            if name.rpartition(".")[2].startswith(GGUF_BLOCKS_BUFFER)]

NATIVE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                "Q6_K")
# HF names of the weights kept as blocks: the projections, the head and the embedding
_BLOCK_SUFFIXES = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"))
_BLOCK_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def block_columns(type_name: str) -> int:
    """Input columns one block of GGML type ``type_name`` encodes (1 for F32 / F16 / BF16, 32
    or 256 for the quantized types)."""
    return GGML_QUANT_SIZES[gguf_loader.GGMLQuantizationType[type_name]][0]


@dataclass(frozen=True)
class GGUFBlocks:
    """Rows of a GGUF weight in its file encoding. ``raw`` uint8 [rows, row_bytes] (a view of
    the file's memory map unless rows were reordered); ``shape`` is the logical (rows, K), so
    the model's loader checks it like a tensor's."""
    raw: torch.Tensor
    type_name: str
    in_features: int
    name: str                     # the GGUF tensor name, for error messages

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.in_features)

    @property
    def type_id(self) -> int:
        return int(gguf_loader.GGMLQuantizationType[self.type_name])

    @staticmethod
    def from_float(weight: torch.Tensor, name: str) -> "GGUFBlocks":
        """A float weight as F32 rows (a layer of a GGUF model that got a float tensor)."""
        w = weight.detach().to(torch.float32).contiguous()
        return GGUFBlocks(w.view(torch.uint8).view(w.shape[0], -1), "F32", w.shape[1], name)

    @property
    def block_columns(self) -> int:
        return block_columns(self.type_name)

    def on_block_boundaries(self, start: int, stop: int) -> bool:
        """Whether input columns [start, stop) begin and end between blocks."""
        return start % self.block_columns == 0 and stop % self.block_columns == 0

    def row_slice(self, start: int, stop: int) -> "GGUFBlocks":
        """Rows [start, stop): a view of the same bytes."""
        return GGUFBlocks(self.raw[start:stop], self.type_name, self.in_features, self.name)

    def column_slice(self, start: int, stop: int) -> "GGUFBlocks":
        """Input columns [start, stop) of every row, in the same encoding (a copy): both ends
        must fall on block boundaries, since a block's scale covers all its columns.

            row:  | block 0 | block 1 | block 2 | block 3 |     block = block_columns inputs,
                            ^start              ^stop           row_bytes / blocks bytes
        """
        block = self.block_columns
        if not self.on_block_boundaries(start, stop):
            raise ValueError(f"columns [{start}, {stop}) of GGUF tensor {self.name!r} do not fall "
                             f"on its {self.type_name} blocks of {block}")
        block_bytes = self.raw.shape[1] // (self.in_features // block)
        raw = self.raw[:, start // block * block_bytes: stop // block * block_bytes].contiguous()
        return GGUFBlocks(raw, self.type_name, stop - start, f"{self.name}[:, {start}:{stop}]")

    def zero_padded(self, rows: int) -> "GGUFBlocks":
        """``rows`` rows: these, then all-zero bytes (which every supported type decodes to
        0.0: zero scales, or zero floats)."""
        if rows == self.raw.shape[0]:
            return self
        raw = torch.zeros(rows, self.raw.shape[1], dtype=torch.uint8)
        raw[: self.raw.shape[0]] = self.raw
        return GGUFBlocks(raw, self.type_name, self.in_features, self.name)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, K] by gguf-py's numpy reference (no compiled kernels needed)."""
        from gguf.quants import dequantize
        values = dequantize(self.raw.numpy(), gguf_loader.GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)


def blocks_weight(blocks: list[GGUFBlocks], in_features: int):
    """What multiplies by shards ``blocks`` (one output row range each): the compiled
    ``GgufWeight`` over their raw bytes (its dot kernels on ``KVFORGE_INT8_DOT``'s instruction:
    VNNI where the CPU has it), or without the kernels their fp32 rows (gguf-py)."""
    ops = cpu_kernels()
    if ops is not None:
        from kvforge.kernels.ops import int8_dot
        rows, panels = shard_gemm_path([b.type_name for b in blocks],
                                       [b.raw.shape[0] for b in blocks])
        return ops.GgufWeight([b.raw for b in blocks], [b.type_id for b in blocks], in_features,
                              gemm_min_rows=rows, int8_panels=panels, int8_dot=int8_dot())
    return torch.cat([b.dequantize() for b in blocks])


def integer_rows_max(model) -> int | None:
    """The most activation rows every compiled GGUF projection of ``model`` (the LM head and
    experts included) multiplies on its integer dot kernels, which give each row the bits it
    gets alone: one less than the smallest crossover to int8 panels or fp32 tiles
    (kernels/gguf_tiles.py), whose rounding differs. None when no projection leaves the dots.
    Speculative verification stays within it, so a verified token is the one a plain decode
    step computes (spec/factory.py)."""
    crossovers = []
    for module in model.modules():
        weights = [getattr(getattr(module, "method", None), "kernel_weight", None)]
        weights += list(getattr(module, "_gguf_w13", None) or ())
        weights += list(getattr(module, "_gguf_w2", None) or ())
        crossovers += [w.gemm_min_rows for w in weights
                       if w is not None and getattr(w, "gemm_min_rows", 0) > 0]
    return min(crossovers) - 1 if crossovers else None


def blocks_multiply(weight, x2d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x2d [M, K] @ W^T (+ bias)`` for a ``blocks_weight`` (fp32 rows in, as the kernel
    takes them). Prompt rows (``layers/prompt_rows.py``) take the weight's many-row kernel at
    any row count, where it has one."""
    if x2d.dtype != torch.float32 or x2d.stride(-1) != 1:
        x2d = x2d.float().contiguous()
    if isinstance(weight, torch.Tensor):
        return torch.nn.functional.linear(x2d, weight, bias)
    return weight.linear(x2d, bias, force_many_rows=computing_prompt_rows())


class GGUFLinearMethod(LinearMethod):
    """A linear layer over ``GGUFBlocks`` shards. Without the compiled kernels the shards are
    dequantized once (gguf-py) and multiplied in fp32, so the engine still runs."""

    def create_weights(self, layer, dtype, device):
        if dtype != torch.float32 or torch.device(device).type not in ("cpu", "meta"):
            raise ValueError(f"GGUF blocks run on fp32 CPU activations; got dtype {dtype}, "
                             f"device {device!r}")
        layer._gguf_shards = []                  # (first output row, GGUFBlocks) as loaded
        layer.bias = None
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                      requires_grad=False)

    def load_weight(self, layer, kind, loaded, output_offset):
        rows = slice(output_offset, output_offset + loaded.shape[0])
        if load_bias_shard(layer, kind, loaded, rows):
            return
        blocks = loaded if isinstance(loaded, GGUFBlocks) else GGUFBlocks.from_float(
            loaded, f"<float rows {output_offset}..>")
        if blocks.in_features != layer.input_size:
            raise ValueError(f"GGUF tensor {blocks.name!r} has {blocks.in_features} columns; the "
                             f"layer takes {layer.input_size}")
        layer._gguf_shards.append((output_offset, blocks))

    def process_weights_after_loading(self, layer):
        shards = sorted(layer._gguf_shards, key=lambda s: s[0])
        expected = 0
        for offset, blocks in shards:
            if offset != expected:
                raise ValueError(f"GGUF layer rows [{expected}, {offset}) were never loaded")
            expected += blocks.shape[0]
        if expected != layer.output_size:
            raise ValueError(f"GGUF layer got {expected} of {layer.output_size} weight rows")
        blocks = [b for _, b in shards]
        for i, b in enumerate(blocks):      # visible to state inspection, never saved
            layer.register_buffer(blocks_buffer_name(i), b.raw, persistent=False)
        self._install(layer, blocks)

    def _install(self, layer, blocks: list[GGUFBlocks]) -> None:
        layer.gguf_blocks = blocks
        # the compiled weight (csrc/gguf_weight.cpp): also what DecodeStack multiplies by
        weight = blocks_weight(blocks, layer.input_size)
        dense = isinstance(weight, torch.Tensor)
        self.kernel_weight = None if dense else weight
        self._dense = weight if dense else None

    def rebind(self, layer) -> None:
        """The layer's ``gguf_raw_i`` buffers now hold other bytes of the same layout (a layer
        the offload store read from disk, kvforge/offload/weight_store.py): multiply by those."""
        self._install(layer, _blocks_over_buffers(layer))

    def release(self, layer) -> None:
        """Drop the layer's bytes (the file's map, or RAM copies of reordered rows) and keep
        only its layout, until ``rebind``: an offloaded layer between its reads."""
        for i, b in enumerate(layer.gguf_blocks):
            layer._buffers[blocks_buffer_name(i)] = torch.empty(0, b.raw.shape[1],
                                                                dtype=torch.uint8)
        layer.gguf_blocks = _blocks_over_buffers(layer)
        self.kernel_weight = self._dense = None

    def apply(self, layer, x):
        weight = self._dense if self._dense is not None else self.kernel_weight
        y = blocks_multiply(weight, x.reshape(-1, layer.input_size), layer.bias)
        return y.view(*x.shape[:-1], layer.output_size)

    def lookup_rows(self, layer, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``ids`` of the weight (an embedding lookup): only those rows dequantized."""
        flat = ids.reshape(-1).long()
        if self._dense is not None:
            rows = self._dense.index_select(0, flat)
        else:
            rows = self.kernel_weight.dequantize(flat)
        return rows.view(*ids.shape, layer.input_size)

    def dequantize(self, layer) -> torch.Tensor:
        """The whole [out, in] weight in fp32 (reference checks)."""
        if self._dense is not None:
            return self._dense.clone()
        return self.kernel_weight.dequantize()


def _blocks_over_buffers(layer) -> list[GGUFBlocks]:
    """The layer's shards (types, widths, names as loaded) over its current ``gguf_raw_i``."""
    return [GGUFBlocks(layer._buffers[blocks_buffer_name(i)], b.type_name, b.in_features, b.name)
            for i, b in enumerate(layer.gguf_blocks)]


class GGUFEmbedding(Linear):
    """A token embedding table kept in GGUF blocks: ``forward(ids)`` dequantizes the rows of
    ``ids`` only. A Linear (vocab x hidden, the same [rows, K] shape as the tied LM head), so
    the model loads it like any projection, and a tied head shares its raw tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(embedding_dim, num_embeddings, method=GGUFLinearMethod())
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.lookup_rows(self, ids)


def _type_error(t, hf_name: str) -> ValueError:
    return ValueError(f"GGUF tensor {t.name!r} ({hf_name}) has GGML type {t.tensor_type.name}, "
                      f"which --quantization gguf cannot run natively (supported: "
                      f"{', '.join(NATIVE_TYPES)}); --quantization none dequantizes it")


def iter_gguf_block_weights(reader) -> Iterator[tuple[str, object]]:
    """(HF name, weight): ``GGUFBlocks`` for projections, head and embedding, float tensors
    for the rest (norms, biases), q/k rows back in HF order."""
    arch = gguf_loader.gguf_architecture(reader)
    config = gguf_loader.gguf_to_hf_config(reader)
    for t in reader.tensors:
        name = gguf_loader.hf_tensor_name(t.name, arch)
        if name is None:
            continue
        as_blocks = name in _BLOCK_NAMES or name.endswith(_BLOCK_SUFFIXES)
        if as_blocks:
            if t.tensor_type.name not in NATIVE_TYPES:
                raise _type_error(t, name)
            shape = gguf_loader._torch_shape(t)
            raw = gguf_loader.raw_rows(t)
            if raw.dim() == 3:          # stacked experts: one GGUFBlocks view per expert
                for expert_name, rows in gguf_loader.split_experts(name, raw):
                    yield expert_name, GGUFBlocks(rows, t.tensor_type.name, shape[-1],
                                                  f"{t.name}[{expert_name.split('.')[-3]}]")
                continue
            weight = GGUFBlocks(raw, t.tensor_type.name, shape[1], t.name)
        else:
            weight = gguf_loader.to_hf_values(arch, name, gguf_loader.tensor_to_torch(t))
        n_head = gguf_loader.qk_permuted_heads(arch, name, config)
        if n_head is not None:
            if as_blocks:    # whole rows gathered into RAM (a copy of these two tensors only)
                weight = GGUFBlocks(gguf_loader.unpermute_qk_rows(weight.raw, n_head),
                                    weight.type_name, weight.in_features, weight.name)
            else:
                weight = gguf_loader.unpermute_qk_rows(weight, n_head)
        yield name, weight


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """Every linear layer, the LM head and the token embedding in the GGUF file's blocks."""

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        return GGUFLinearMethod()

    def get_experts_method(self, prefix: str):
        from kvforge.quant.gguf_experts import GGUFExpertsMethod
        return GGUFExpertsMethod()

    def replace_modules(self, model) -> int:
        """Token embeddings become ``GGUFEmbedding``s (before any weight is loaded)."""
        replaced = 0
        for prefix, module in list(model.named_modules()):
            if type(module) is nn.Embedding and prefix.endswith("embed_tokens"):
                parent_name, _, leaf = prefix.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, leaf, GGUFEmbedding(module.num_embeddings, module.embedding_dim))
                replaced += 1
        return replaced

    def iter_weights(self, source):
        if source.format != "gguf":
            raise ValueError(f"--quantization gguf runs a GGUF file's own blocks; "
                             f"{source.path!r} is a {source.format} model (use int4 or int8)")
        return source.select_weights(iter_gguf_block_weights(source.gguf_reader()))
