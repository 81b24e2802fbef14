"""A lazy GGUF reader: the header parsed in milliseconds, tensors as views of one memory map.

``gguf.GGUFReader`` decodes every metadata value element by element through numpy memmap
slices when the file is opened: for a 49k-token vocabulary (three arrays of ~49k entries) that
is seconds, longer than the rest of start-up, and kvforge needs those arrays only to build a
tokenizer it then caches. Here each key/value is located in one pass that skips over arrays
(numeric arrays by their byte size, string arrays by walking their length prefixes) and decoded
only when ``contents()`` is called; tensors are plain ``numpy`` views (not ``np.memmap``
subclasses, whose per-slice bookkeeping dominated dequantization) with the same shapes, types
and fields as ``gguf.ReaderTensor``, so the rest of the loader and ``gguf.quants`` take them
as they are. The format constants (value types, quantization block sizes) come from ``gguf``.

File layout (GGUF v2/v3, little-endian)::

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv x  [ key: u64 len + utf-8 | u32 value type | value ]
              value: scalar | string (u64 len + bytes) | array (u32 elem type, u64 count, elems)
    n_tensors x [ name: u64 len + utf-8 | u32 n_dims | n_dims x u64 (ggml order, fastest first)
                  | u32 ggml type | u64 offset from the data start ]
    padding to general.alignment (default 32) | tensor data
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY_TYPES: dict[GGMLQuantizationType, Any] = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFField:
    """One metadata key; its value is decoded on the first ``contents()``."""

    name: str
    types: list[GGUFValueType]           # [type] or [ARRAY, element type]
    _file: "GGUFFile" = field(repr=False)
    _offset: int = field(repr=False)      # where the value (after its type) starts
    _count: int = 1                       # array length
    _cached: Any = field(default=None, repr=False)
    _decoded: bool = field(default=False, repr=False)

    def contents(self) -> Any:
        if not self._decoded:
            self._cached = self._file._decode(self)
            self._decoded = True
        return self._cached

    def __len__(self) -> int:
        return self._count


class GGUFFile:
    """``GGUFFile(path)``: ``fields`` (key -> GGUFField) and ``tensors`` (gguf.ReaderTensor)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"{path!r} is too short to be a GGUF file ({size} bytes)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._size = size
        self._bytes = memoryview(self._map)
        if bytes(self._bytes[:4]) != _MAGIC:
            raise GGUFFormatError(f"{path!r} does not start with the GGUF magic")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._map, 4)
        if self.version not in _SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"{path!r}: GGUF version {self.version} is not supported "
                                  f"({_SUPPORTED_VERSIONS})")
        pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,), pos = self._unpack("<I", pos)
            value_type = self._value_type(vtype, key)
            if value_type == GGUFValueType.ARRAY:
                (etype, count), pos = self._unpack("<IQ", pos)
                elem_type = self._value_type(etype, key)
                entry = GGUFField(key, [value_type, elem_type], self, pos, count)
                pos = self._skip_array(pos, elem_type, count, key)
            else:
                entry = GGUFField(key, [value_type], self, pos)
                pos = self._skip_value(pos, value_type, key)
            self.fields[key] = entry
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,), pos = self._unpack("<I", pos)
            if n_dims > 8:
                raise GGUFFormatError(f"{path!r}: tensor {name!r} has {n_dims} dimensions")
            dims, pos = self._unpack(f"<{n_dims}Q", pos)
            (raw_type, offset), pos = self._unpack("<IQ", pos)
            infos.append((name, dims, raw_type, offset))
        alignment = _DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            alignment = int(self.fields["general.alignment"].contents())
            if alignment <= 0 or alignment & (alignment - 1):
                raise GGUFFormatError(f"{path!r}: general.alignment {alignment} is not a power of 2")
        self.data_offset = -(-pos // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise GGUFFormatError(f"{path!r} names a tensor twice")

    # ---- parsing helpers ---------------------------------------------------------------------
    def _need(self, pos: int, n: int, what: str) -> None:
        if n < 0 or pos + n > self._size:
            raise GGUFFormatError(f"{self.path!r} is truncated: {what} needs bytes [{pos}, "
                                  f"{pos + n}) of {self._size}")

    def _unpack(self, fmt: str, pos: int) -> tuple[tuple, int]:
        n = struct.calcsize(fmt)
        self._need(pos, n, "the header")
        return struct.unpack_from(fmt, self._map, pos), pos + n

    def _string(self, pos: int) -> tuple[str, int]:
        (n,), pos = self._unpack("<Q", pos)
        self._need(pos, n, "a string")
        return str(self._bytes[pos:pos + n], "utf-8", errors="replace"), pos + n

    def _value_type(self, raw: int, key: str) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFFormatError(f"{self.path!r}: key {key!r} has unknown value type {raw}") from None

    def _skip_value(self, pos: int, value_type: GGUFValueType, key: str) -> int:
        if value_type == GGUFValueType.STRING:
            return self._string(pos)[1]
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path!r}: key {key!r} has a nested array")
        n = struct.calcsize(fmt)
        self._need(pos, n, f"key {key!r}")
        return pos + n

    def _skip_array(self, pos: int, elem_type: GGUFValueType, count: int, key: str) -> int:
        if elem_type == GGUFValueType.STRING:
            # length-prefixed: walk the prefixes only (a 152k vocabulary + merges are ~300k
            # strings, so the loop stays minimal; a length past the end is caught at the next
            # prefix or at the end)
            unpack, data, size = struct.unpack_from, self._map, self._size
            for _ in range(count):
                if pos + 8 > size:
                    self._need(pos, 8, f"key {key!r}")     # raises: truncated
                pos += 8 + unpack("<Q", data, pos)[0]
            self._need(pos, 0, f"key {key!r}")
            return pos
        fmt = _SCALAR_FORMATS.get(elem_type)
        if fmt is None:
            raise GGUFFormatError(f"{self.path!r}: key {key!r} has a nested array")
        n = struct.calcsize(fmt) * count
        self._need(pos, n, f"key {key!r}")
        return pos + n

    def _decode(self, entry: GGUFField) -> Any:
        pos = entry._offset
        if entry.types[0] == GGUFValueType.STRING:
            return self._string(pos)[0]
        if entry.types[0] != GGUFValueType.ARRAY:
            return struct.unpack_from(_SCALAR_FORMATS[entry.types[0]], self._map, pos)[0]
        elem_type = entry.types[1]
        if elem_type == GGUFValueType.STRING:
            out = []
            for _ in range(entry._count):
                text, pos = self._string(pos)
                out.append(text)
            return out
        dtype = np.dtype(_SCALAR_FORMATS[elem_type])
        return np.frombuffer(self._map, dtype=dtype, count=entry._count, offset=pos).tolist()

    def _tensor(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> ReaderTensor:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{self.path!r}: tensor {name!r} has unknown ggml type "
                                  f"{raw_type}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise GGUFFormatError(f"{self.path!r}: tensor {name!r} has ggml type "
                                  f"{ggml_type.name} with no known block size")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(dims)) if dims else 1
        if n_elements % block_size:
            raise GGUFFormatError(f"{self.path!r}: tensor {name!r} of {n_elements} elements is "
                                  f"not whole {ggml_type.name} blocks")
        n_bytes = n_elements // block_size * type_size
        start = self.data_offset + offset
        self._need(start, n_bytes, f"tensor {name!r}")
        logical = tuple(reversed(dims))
        if ggml_type in _NUMPY_TYPES:
            data = np.frombuffer(self._map, dtype=_NUMPY_TYPES[ggml_type], count=n_elements,
                                 offset=start).reshape(logical)
        else:
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start).reshape(
                quant_shape_to_byte_shape(logical, ggml_type))
        return ReaderTensor(name=name, tensor_type=ggml_type,
                            shape=np.array(dims, dtype=np.uint64), n_elements=n_elements,
                            n_bytes=n_bytes, data_offset=start, data=data, field=None)
