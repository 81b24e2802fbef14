"""GGUF blocks kept quantized (``--quantization gguf``): Q4_0 / Q4_1 tensors go straight into
the INT4 format (group 32) without a float copy.

ggml block layouts (32 weights each, fp16 d / m, little-endian):

    Q4_1  [d:2][m:2][qs:16]   w[j] = d * q[j] + m          q[j] = qs[j] & 15,  q[j+16] = qs[j] >> 4
    Q4_0  [d:2][qs:16]        w[j] = d * (q[j] - 8)

Our INT4 format is w = (q - 8) * scale + zero (packing.py), so Q4_1 -> scale = d, zero = m + 8d
and Q4_0 -> scale = d, zero = 0: the 4-bit codes are kept bit for bit. (d and zero are then
rounded to bf16, the scale type of the CPU kernel: ~0.4% relative, the same order as the bf16
activations the kernel runs on.)

q_proj / k_proj rows are stored in llama.cpp's rotary order; a row permutation of the codes and
of their per-row scales is exact, so ``unpermute_qk_rows`` applies to them as to float rows.
Other tensor types of a linear layer (Q8_0, F16, K-quants, ...) are dequantized and requantized
by INT4 RTN with group 32; the LM head (the default model's tied Q8_0 embedding) is INT8 per
channel or float (``lm_head``), and norms / embeddings stay float.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch

from kvforge.layers.linear import LinearMethod
from kvforge.loader import gguf_loader
from kvforge.quant.base import is_lm_head, QuantizationConfig, register_quantization
from kvforge.quant.int4 import Int4Blocks, Int4LinearMethod
from kvforge.quant.int8 import lm_head_method

logger = logging.getLogger(__name__)

GGUF_GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_LINEAR_SUFFIXES = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"))


def q4_blocks_to_int4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Blocks:
    """Raw Q4_0 / Q4_1 bytes of a [N, K] tensor -> ``Int4Blocks`` (group 32, codes unchanged)."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"cannot keep GGML type {type_name} as int4; only {sorted(_BLOCK_BYTES)}")
    n, k = shape
    if k % GGUF_GROUP:
        raise ValueError(f"{type_name} tensor of shape {shape} has rows not made of 32-wide blocks")
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(n, k // GGUF_GROUP,
                                                             _BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if type_name == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        qs = blocks[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = blocks[..., 2:]
        zero = torch.zeros_like(d)
    # byte j holds weight j (low nibble) and weight j + 16 (high nibble) of its block
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
    return Int4Blocks(codes.contiguous(), d.to(torch.bfloat16), zero.to(torch.bfloat16), k)


def _permute_rows(b: Int4Blocks, n_head: int) -> Int4Blocks:
    unperm = gguf_loader.unpermute_qk_rows
    return Int4Blocks(unperm(b.codes, n_head), unperm(b.scale, n_head), unperm(b.zero, n_head),
                      b.in_features)


def iter_gguf_int4_weights(reader) -> Iterator[tuple[str, object]]:
    """Like ``gguf_loader.iter_gguf_weights`` but Q4_0/Q4_1 projection weights come out as
    ``Int4Blocks`` (never dequantized); everything else as float tensors."""
    arch = gguf_loader.gguf_architecture(reader)
    config = gguf_loader.gguf_to_hf_config(reader)
    permuted = arch in gguf_loader._PERMUTED_QK_ARCHS
    requantized = []
    for t in reader.tensors:
        name = gguf_loader.hf_tensor_name(t.name, arch)
        if name is None:
            continue
        type_name = t.tensor_type.name
        if name.endswith(_LINEAR_SUFFIXES) and type_name in _BLOCK_BYTES:
            raw = np.asarray(t.data).view(np.uint8).reshape(-1)
            weight = q4_blocks_to_int4(raw, type_name, gguf_loader._torch_shape(t))
            row_permute = _permute_rows
        else:
            weight = gguf_loader.to_hf_values(arch, name, gguf_loader.tensor_to_torch(t))
            row_permute = gguf_loader.unpermute_qk_rows
            if name.endswith(_LINEAR_SUFFIXES):
                requantized.append(f"{name} ({type_name})")
        if permuted and ".self_attn.q_proj." in name:
            weight = row_permute(weight, config["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in name:
            weight = row_permute(weight, config["num_key_value_heads"])
        yield name, weight
    if requantized:
        logger.warning("gguf: %d linear weights were not Q4_0/Q4_1 and were requantized to int4 "
                       "by RTN (group 32), e.g. %s", len(requantized), requantized[0])


@register_quantization("gguf")
class GGUFConfig(QuantizationConfig):
    """Projection layers: INT4 group 32 from the file's Q4 blocks. ``lm_head``: "int8" (default)
    or "none" (float, e.g. to compare with the dequantized model at kernel tolerance)."""

    def __init__(self, lm_head: str = "int8") -> None:
        lm_head_method(lm_head, "lm_head")
        self.lm_head = lm_head

    def get_linear_method(self, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return lm_head_method(self.lm_head, prefix)
        return Int4LinearMethod(GGUF_GROUP)

    def iter_weights(self, source):
        if source.format != "gguf":
            raise ValueError(f"--quantization gguf keeps a GGUF file's blocks; {source.path!r} "
                             f"is a {source.format} model (use int4 or int8)")
        reader = source._reader if source._reader is not None else gguf_loader.open_gguf(source.path)
        return iter_gguf_int4_weights(reader)

    def describe(self) -> dict:
        return {"lm_head": self.lm_head}
