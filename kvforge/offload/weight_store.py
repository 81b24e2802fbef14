"""The disk tier's weights: one file per decoder layer holding that layer's tensors in their
storage format (fp32 rows, or a GGUF file's own blocks: the ``gguf_raw_i`` buffers of
``quant/gguf.py``), each tensor at a 4 KiB-aligned offset so a layer is one direct read; the
embedding table (which is the LM head when tied) as one row-major file, fp32 rows or GGUF
block rows; ``manifest.json`` last (a store without it is incomplete and is rebuilt).

Reading binds a layer: its module's parameters and buffers become views into the buffer just
read (a linear method with a compiled weight over them, GGUF's, rebuilds it: ``rebind``), so
the layer's own forward runs unchanged on streamed weights.

    manifest entry of a matrix (embedding / head)
      fp32:  {"file", "dtype": "float32", "shape": [vocab, hidden]}
      GGUF:  {"file", "dtype": "uint8", "shape": [vocab, hidden], "gguf_type": "Q6_K",
              "row_bytes": bytes of one row's blocks}"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.offload.direct_io import ALIGN, DiskFile, align_up, write_file
from kvforge.quant.gguf import blocks_buffer_name

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


def _logical_params(layer: nn.Module) -> dict[str, int]:
    """Weights each GGUF raw buffer stands for (its bytes are not its parameter count)."""
    params = {}
    for mod_name, module in layer.named_modules():
        for i, b in enumerate(getattr(module, "gguf_blocks", None) or []):
            name = f"{mod_name}.{blocks_buffer_name(i)}" if mod_name else blocks_buffer_name(i)
            params[name] = b.shape[0] * b.in_features
    return params


def _methods(layer: nn.Module):
    for module in layer.modules():
        method = getattr(module, "method", None)
        if method is not None:
            yield module, method


def release_layer(layer: nn.Module) -> None:
    """Drop a bound layer's bytes until it is bound again (its parameters become empty; GGUF
    layers keep their blocks' layout): what a streamed layer holds between its reads."""
    for p in layer.parameters():
        p.data = torch.empty(0, dtype=p.dtype)
    for module, method in _methods(layer):
        if hasattr(method, "release"):
            method.release(module)


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
        logical = _logical_params(layer)
        for e in entries:
            e["params"] = logical.get(e["name"], math.prod(e["shape"]))
        name = f"layer_{j:04d}.bin"
        tensors = dict(layer_tensors(layer))
        write_file(os.path.join(directory, name),
                   [(e["offset"], _raw(tensors[e["name"]])) for e in entries], size)
        manifest["layers"].append({"file": name, "nbytes": size, "tensors": entries})
    embed, embed_entry = _matrix_of(model.model.embed_tokens)
    _write_matrix(directory, "embed.bin", embed)
    manifest["embedding"] = {"file": "embed.bin", **embed_entry}
    head, head_entry = _matrix_of(model.lm_head)
    if head.data_ptr() == embed.data_ptr() and head.shape == embed.shape:
        manifest["head"] = manifest["embedding"]
    else:
        _write_matrix(directory, "head.bin", head)
        manifest["head"] = {"file": "head.bin", **head_entry}
    norm = model.model.norm.weight
    _write_matrix(directory, "norm.bin", norm.reshape(1, -1))
    manifest["norm"] = _matrix_entry("norm.bin", norm.reshape(1, -1))
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def _matrix_of(module: nn.Module) -> tuple[torch.Tensor, dict]:
    """(the rows to write, their manifest fields) of an embedding / head module: its fp32
    weight, or the raw rows of its single GGUF shard."""
    blocks = getattr(module, "gguf_blocks", None)
    if blocks is None:
        w = module.weight
        return w, {"dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape)}
    if len(blocks) != 1:
        raise ValueError(f"an offloaded embedding / head is one GGUF tensor, got {len(blocks)}")
    b = blocks[0]
    return b.raw, {"dtype": "uint8", "shape": [b.shape[0], b.in_features],
                   "gguf_type": b.type_name, "row_bytes": b.raw.shape[1]}


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
        self.head_row_bytes = _row_bytes(self.head)
        self.embed_row_bytes = _row_bytes(self.embedding)
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
    def stage_bytes(self) -> int:
        """A loader slot: a layer, or a head chunk (at least one aligned group of rows: 1,024
        rows of GGUF blocks whose row bytes are 4 mod 8, more than a tiny model's layer)."""
        return max(self.layer_bytes, max(c.nbytes for c in self.head_chunks(self.layer_bytes)))

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

    def head_chunk_weight(self, chunk: HeadChunk, buf: torch.Tensor):
        """The chunk's rows as read into ``buf``: an fp32 [rows, hidden] tensor, or for GGUF
        rows what multiplies by them (``quant/gguf.blocks_weight``)."""
        n = chunk.row_end - chunk.row_start
        return _rows_weight(self.head, buf[:n * self.head_row_bytes].view(n, self.head_row_bytes),
                            f"head rows {chunk.row_start}..{chunk.row_end}")

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] fp32 rows read from the embedding file."""
        rb = self.embed_row_bytes
        unique, inverse = torch.unique(ids, return_inverse=True)
        raw = torch.empty(len(unique), rb, dtype=torch.uint8)
        dest = raw.numpy()
        for i, tok in enumerate(unique.tolist()):
            data = os.pread(self._embed_fd, rb, tok * rb)
            dest[i] = memoryview(data)
            os.posix_fadvise(self._embed_fd, tok * rb, rb, os.POSIX_FADV_DONTNEED)
        self.embed_bytes_read += len(unique) * rb
        rows = _rows_weight(self.embedding, raw, "embedding rows")
        if not isinstance(rows, torch.Tensor):          # GGUF blocks: only these rows, to fp32
            rows = rows.dequantize(None)
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
        for module, method in _methods(layer):
            if hasattr(method, "rebind"):
                method.rebind(module)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        os.close(self._embed_fd)


def _row_bytes(entry: dict) -> int:
    if "row_bytes" in entry:
        return int(entry["row_bytes"])
    return entry["shape"][1] * torch.empty((), dtype=getattr(torch, entry["dtype"])).element_size()


def _rows_weight(entry: dict, raw: torch.Tensor, name: str):
    """Rows of a matrix entry from their bytes ``raw`` [rows, row bytes] (uint8): fp32 rows
    (a view), or GGUF block rows as ``quant/gguf.blocks_weight`` (the compiled weight)."""
    hidden = entry["shape"][1]
    if "gguf_type" not in entry:
        return raw.view(getattr(torch, entry["dtype"])).view(raw.shape[0], hidden)
    from kvforge.quant.gguf import GGUFBlocks, blocks_weight
    return blocks_weight([GGUFBlocks(raw, entry["gguf_type"], hidden, name)], hidden)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
