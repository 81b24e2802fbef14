"""Bit-packing of small unsigned codes (1..8 bits each) along the last dimension.

Row r's codes c_0, c_1, ... are written least-significant bit first into a bit stream that is
cut into bytes (bit j of the stream is bit j % 8 of byte j // 8): L codes of b bits take
ceil(L b / 8) bytes, so 3-bit codes cost 3 bits, not the 4 of a nibble.
"""
from __future__ import annotations

import torch

_BYTE_WEIGHTS = 2 ** torch.arange(8, dtype=torch.int32)


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"codes must be 1..8 bits wide, got {bits!r}")
    return bits


def packed_bytes(length: int, bits: int) -> int:
    return -(-length * bits // 8)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [m, L] (values < 2**bits) -> uint8 [m, ceil(L bits / 8)]."""
    check_bits(bits)
    m, length = codes.shape
    c = codes.to(torch.int32)
    if bool((c >= (1 << bits)).any()) or bool((c < 0).any()):
        raise ValueError(f"codes do not fit in {bits} bits")
    stream = ((c[..., None] >> torch.arange(bits, dtype=torch.int32)) & 1).view(m, -1)
    nbytes = packed_bytes(length, bits)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - stream.shape[1]))
    return (stream.view(m, nbytes, 8) * _BYTE_WEIGHTS).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint8 [m, nbytes] -> uint8 codes [m, length]."""
    check_bits(bits)
    m = packed.shape[0]
    if length % 8 == 0:
        # 8 codes fill exactly ``bits`` bytes: read them as one little-endian integer and
        # shift each code out (8x fewer elements than the bit stream below)
        chunks = packed[:, :length * bits // 8].to(torch.int64).view(m, length // 8, bits)
        word = (chunks << (8 * torch.arange(bits))).sum(dim=-1, keepdim=True)
        codes = (word >> (bits * torch.arange(8))) & ((1 << bits) - 1)
        return codes.view(m, length).to(torch.uint8)
    stream = ((packed.to(torch.int32)[..., None] >> torch.arange(8, dtype=torch.int32)) & 1)
    stream = stream.view(m, -1)[:, :length * bits].view(m, length, bits)
    return (stream * _BYTE_WEIGHTS[:bits]).sum(dim=-1).to(torch.uint8)
