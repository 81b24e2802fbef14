"""The disk tier's weights: one file per decoder layer holding that layer's tensors in their
storage format (whatever its linear methods keep: fp32 rows, int8 codes + scales, ...), each
tensor at a 4 KiB-aligned offset so a layer is one direct read; the embedding table (which is
the LM head when tied) as one row-major file; ``manifest.json`` last (a store without it is
incomplete and is rebuilt).

Reading binds a layer: its module's parameters become views into the buffer just read, so the
layer's own forward runs unchanged on streamed weights."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.offload.direct_io import ALIGN, DiskFile, align_up, write_file

MANIFEST = "manifest.json"
STORE_VERSION = 1


def layer_tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a layer's forward reads: parameters and buffers. A tensor hidden in a plain
    attribute (a method's compiled weight object) could not be streamed: refuse such layers."""
    found = dict(layer.named_parameters(remove_duplicate=False))
    found.update(dict(layer.named_buffers(remove_duplicate=False)))
    for mod_name, module in layer.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                raise ValueError(f"layer tensor {mod_name}.{attr} is not a parameter or buffer; "
                                 f"offloading streams fp32/int8-style layers (use "
                                 f"quantization='none')")
    return sorted(found.items())


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[dict], int]:
    entries, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        offset = align_up(offset + nbytes)
    return entries, max(offset, ALIGN)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def store_key(source_path: str, quantization: str, dtype: str) -> str:
    st = os.stat(source_path)
    ident = f"v{STORE_VERSION}|{os.path.abspath(source_path)}|{st.st_size}|{st.st_mtime_ns}|" \
            f"{quantization}|{dtype}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def build_store(model: nn.Module, directory: str, info: dict | None = None) -> None:
    """Write a loaded Llama-family model's weights as a store in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    manifest: dict = {"version": STORE_VERSION, "info": info or {}, "layers": []}
    for j, layer in enumerate(model.model.layers):
        entries, size = _layout(layer_tensors(layer))
        name = f"layer_{j:04d}.bin"
        tensors = dict(layer_tensors(layer))
        write_file(os.path.join(directory, name),
                   [(e["offset"], _raw(tensors[e["name"]])) for e in entries], size)
        manifest["layers"].append({"file": name, "nbytes": size, "tensors": entries})
    embed = model.model.embed_tokens.weight
    _write_matrix(directory, "embed.bin", embed)
    manifest["embedding"] = _matrix_entry("embed.bin", embed)
    head = model.lm_head.weight
    if head.data_ptr() == embed.data_ptr() and head.shape == embed.shape:
        manifest["head"] = manifest["embedding"]
    else:
        _write_matrix(directory, "head.bin", head)
        manifest["head"] = _matrix_entry("head.bin", head)
    norm = model.model.norm.weight
    _write_matrix(directory, "norm.bin", norm.reshape(1, -1))
    manifest["norm"] = _matrix_entry("norm.bin", norm.reshape(1, -1))
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def _write_matrix(directory: str, name: str, t: torch.Tensor) -> None:
    size = align_up(t.numel() * t.element_size())
    write_file(os.path.join(directory, name), [(0, _raw(t))], size)


def _matrix_entry(name: str, t: torch.Tensor) -> dict:
    return {"file": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


@dataclass(frozen=True)
class HeadChunk:
    row_start: int
    row_end: int
    offset: int          # aligned
    nbytes: int          # aligned read length


class WeightStore:
    """An opened store: direct reads of layers and head chunks, row reads of the embedding."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, MANIFEST)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no offload weight store at {directory!r} ({MANIFEST} "
                                    f"missing)")
        with open(path) as f:
            self.manifest = json.load(f)
        self.directory = directory
        self.layers = self.manifest["layers"]
        self.embedding = self.manifest["embedding"]
        self.head = self.manifest["head"]
        # every file opened now: the loader thread reads them while the compute thread sums
        # ``bytes_read``, so the dict must not grow under either
        self._files: dict[str, DiskFile] = {
            name: DiskFile(os.path.join(directory, name))
            for name in dict.fromkeys([e["file"] for e in self.layers] + [self.head["file"]])}
        self.dtype = getattr(torch, self.head["dtype"])
        vocab, hidden = self.head["shape"]
        self.head_row_bytes = hidden * torch.empty((), dtype=self.dtype).element_size()
        # embedding rows are small random reads: buffered, then dropped from the page cache
        self._embed_fd = os.open(os.path.join(directory, self.embedding["file"]), os.O_RDONLY)
        self.embed_bytes_read = 0

    def file(self, name: str) -> DiskFile:
        return self._files[name]

    @property
    def direct(self) -> bool:
        return self.file(self.layers[0]["file"]).direct

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values()) + self.embed_bytes_read

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_bytes(self) -> int:
        return max(layer["nbytes"] for layer in self.layers)

    @property
    def head_bytes(self) -> int:
        vocab, _ = self.head["shape"]
        return vocab * self.head_row_bytes

    def read_layer(self, j: int, buf: memoryview) -> None:
        layer = self.layers[j]
        self.file(layer["file"]).read_into(buf[:layer["nbytes"]], 0)

    def head_chunks(self, max_bytes: int) -> list[HeadChunk]:
        """Row ranges of the head, each starting at an aligned offset and at most ``max_bytes``
        (rounded to whole aligned row groups) long."""
        vocab, _ = self.head["shape"]
        rb = self.head_row_bytes
        group = ALIGN // _gcd(rb, ALIGN)                  # rows per aligned offset step
        rows = max(group, max_bytes // rb // group * group)
        chunks = []
        for start in range(0, vocab, rows):
            end = min(start + rows, vocab)
            chunks.append(HeadChunk(start, end, start * rb, align_up((end - start) * rb)))
        return chunks

    def read_head_chunk(self, chunk: HeadChunk, buf: memoryview) -> None:
        f = self.file(self.head["file"])
        size = os.fstat(f.fd).st_size
        n = min(chunk.nbytes, size - chunk.offset)
        f.read_into(buf[:n], chunk.offset)

    def head_chunk_tensor(self, chunk: HeadChunk, buf: torch.Tensor) -> torch.Tensor:
        _, hidden = self.head["shape"]
        n = chunk.row_end - chunk.row_start
        return buf[:n * self.head_row_bytes].view(self.dtype).view(n, hidden)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] rows read from the embedding file."""
        _, hidden = self.embedding["shape"]
        rb = self.head_row_bytes
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = torch.empty(len(unique), hidden, dtype=self.dtype)
        raw = rows.view(torch.uint8).numpy().reshape(len(unique), rb)
        for i, tok in enumerate(unique.tolist()):
            data = os.pread(self._embed_fd, rb, tok * rb)
            raw[i] = memoryview(data)
            os.posix_fadvise(self._embed_fd, tok * rb, rb, os.POSIX_FADV_DONTNEED)
        self.embed_bytes_read += len(unique) * rb
        return rows[inverse]

    def read_norm(self) -> torch.Tensor:
        entry = self.manifest["norm"]
        n = entry["shape"][1]
        elem = torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()
        with open(os.path.join(self.directory, entry["file"]), "rb") as f:
            data = bytearray(f.read(n * elem))
        return torch.frombuffer(data, dtype=getattr(torch, entry["dtype"])).clone()

    def bind_layer(self, layer: nn.Module, j: int, buf: torch.Tensor) -> None:
        """Point layer j's parameters and buffers at the bytes read into ``buf`` (uint8)."""
        for e in self.layers[j]["tensors"]:
            mod_name, _, attr = e["name"].rpartition(".")
            module = layer.get_submodule(mod_name) if mod_name else layer
            view = buf[e["offset"]:e["offset"] + e["nbytes"]].view(getattr(torch, e["dtype"]))
            view = view.view(e["shape"])
            if attr in module._parameters:
                module._parameters[attr].data = view
            elif attr in module._buffers:
                module._buffers[attr] = view
            else:
                raise ValueError(f"store tensor {e['name']!r} has no place in layer {j}")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        os.close(self._embed_fd)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
