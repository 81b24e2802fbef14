"""Linear layers whose storage and kernel are chosen by a ``LinearMethod``.

A layer only knows its logical shape ``y[T, out] = x[T, in] @ W[out, in]^T + b``; the method decides
how W is stored and multiplied, so a quantized method (int8, int4, ...) replaces the plain one
without touching model code. Fused projections (q|k|v, gate|up) are one layer with several
output shards, each loaded from its own Hugging Face tensor:

    MergedLinear(output_sizes=[q, k, v])       logical W rows:  [0, q) [q, q+k) [q+k, q+k+v)
    load_shard(1, k_proj.weight)  copies into rows               ^^^^^^^^ offset = q

The plain method keeps HF's [out, in] layout (so a tied LM head shares the embedding tensor) and
picks the kernel by the number of rows M (``benchmarks/linear_kernel.py``, all 120 projections
of SmolLM2-135M, 2 threads, idle box, ms):

    M        1     2     3     4     8     16    32    64    128   256   384   512
    F.linear 35.0  56.4  67.0  45.9  40.7  48.8  67.8  101.7 178.4 327.5 495.3 651.0
    W @ x^T  15.2  14.9  20.8  21.7  34.8  46.7  64.8  102.0 178.9 358.2 584.3 791.4
    kvforge  14.1  14.0  14.7  14.9  15.5  28.6  46.7  82.8  158.7 338.1 535.8 728.4

torch's default ``F.linear`` is a slow matrix-vector product at small M; the compiled
register-tiled kernel (kernels/csrc/linear.cpp) runs 1..256 rows (decodes, speculative
verification, short prefill chunks; 1-8 rows in one pass over W at memory speed); F.linear (MKL
with packing) longer chunks. Without the compiled kernels: ``W @ x^T`` up to 128 rows (for
M = 1 the row duplicated: the 2-column GEMM reads W once, ~2x MKL's gemv) and F.linear beyond.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from kvforge.kernels import ops as kernel_ops
from kvforge.kernels.huge_pages import huge_page_zeros


class LinearMethod(ABC):
    """Contract: ``create_weights`` registers the layer's parameters; ``load_weight`` receives a
    slice of the logical weight (``kind="weight"``: [n, in] in HF layout; ``kind="bias"``: [n])
    destined for output rows ``[output_offset, output_offset + n)``; after every shard is loaded
    the model calls ``process_weights_after_loading`` once (e.g. to quantize); ``apply`` returns
    ``x @ W^T (+ b)`` for ``x`` of shape [..., in]."""

    @abstractmethod
    def create_weights(self, layer: "Linear", dtype: torch.dtype, device: torch.device | str) -> None: ...

    @abstractmethod
    def load_weight(self, layer: "Linear", kind: str, loaded: torch.Tensor, output_offset: int) -> None: ...

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethod):
    """Dense float ``weight`` [out, in] (HF layout); the GEMM form is picked by batch rows."""

    W_FIRST_MAX = 128  # without the compiled kernel, ``W @ x^T`` beats F.linear up to here

    def create_weights(self, layer, dtype, device):
        layer.weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device),
            requires_grad=False)
        layer.bias = None
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.zeros(layer.output_size, dtype=dtype, device=device),
                                      requires_grad=False)

    def load_weight(self, layer, kind, loaded, output_offset):
        n = loaded.shape[0]
        if kind == "weight":
            if loaded.dim() != 2 or loaded.shape[1] != layer.input_size:
                raise ValueError(f"weight of shape {tuple(loaded.shape)} does not fit a linear layer "
                                 f"with input_size {layer.input_size}")
            layer.weight[output_offset:output_offset + n].copy_(loaded)
        elif kind == "bias":
            if not layer.has_bias:
                raise ValueError("got a bias for a linear layer created without bias")
            layer.bias[output_offset:output_offset + n].copy_(loaded)
        else:
            raise ValueError(f"unknown linear parameter kind {kind!r}; expected 'weight' or 'bias'")

    def apply(self, layer, x):
        x2d = x.reshape(-1, layer.input_size)
        rows = x2d.shape[0]
        y = kernel_ops.linear_rows(x2d, layer.weight)
        if y is None:
            if rows == 1:
                # [x; x]: the 2-column GEMM streams W ~2x faster than MKL's gemv does
                y = torch.mm(layer.weight, x2d.expand(2, -1).contiguous().t())[:, 0].contiguous()[None]
            elif 1 < rows <= self.W_FIRST_MAX:
                y = torch.mm(layer.weight, x2d.t()).t().contiguous()
            else:
                return torch.nn.functional.linear(x2d, layer.weight, layer.bias).view(
                    *x.shape[:-1], layer.output_size)
        if layer.bias is not None:
            y += layer.bias
        return y.view(*x.shape[:-1], layer.output_size)


class PackedLinearMethod(LinearMethod):
    """An fp32 weight in the compiled kernel's packed layout (``kernels/ops.py``): one
    sequential stream per thread instead of 8 row streams, which keeps up better with fast
    memory (``kernels/csrc/linear.cpp``). Layers arrive here loaded, converted by
    ``pack_linear``; more than ``LINEAR_ROWS_MAX`` rows (long prefill chunks) run MKL on a
    row-major copy made for the call (a few % of such a GEMM's time)."""

    def create_weights(self, layer, dtype, device):
        raise TypeError("PackedLinearMethod converts loaded layers (pack_linear); "
                        "create layers with UnquantizedLinearMethod")

    def load_weight(self, layer, kind, loaded, output_offset):
        raise ValueError("this linear layer's weight is packed for the CPU kernels; "
                         "load weights before the layer is packed")

    @staticmethod
    def dense_weight(layer) -> torch.Tensor:
        """The [out, in] weight, unpacked (a new tensor)."""
        return kernel_ops.unpack_linear_weight(layer.packed_weight, layer.output_size)

    def apply(self, layer, x):
        x2d = x.reshape(-1, layer.input_size)
        y = kernel_ops.linear_packed(x2d, layer.packed_weight, layer.output_size)
        if y is None:
            y = torch.nn.functional.linear(x2d, self.dense_weight(layer))
        if layer.bias is not None:
            y += layer.bias
        return y.view(*x.shape[:-1], layer.output_size)


def pack_linear(layer: "Linear", out: torch.Tensor | None = None) -> bool:
    """Convert a loaded fp32 CPU ``layer`` with the plain method to ``PackedLinearMethod`` in
    place (the row-major weight is freed; the packed one written into ``out`` when given, a
    tensor of ``packing_shape(layer)``) where this build's packed kernel is the faster one.
    True when the layer is packed (now or before)."""
    if type(layer.method) is PackedLinearMethod:
        return True
    if packing_shape(layer) is None:
        return False
    packed = kernel_ops.pack_linear_weight(layer.weight, out)
    del layer.weight
    layer.packed_weight = nn.Parameter(packed, requires_grad=False)
    layer.method = PackedLinearMethod()
    return True


def packing_shape(layer: "Linear") -> tuple[int, ...] | None:
    """The packed weight's shape if ``pack_linear`` would pack ``layer`` now, else None."""
    if type(layer.method) is not UnquantizedLinearMethod or not kernel_ops.packing_pays():
        return None
    return kernel_ops.packed_shape(layer.weight)


def place_linears(layers: "list[Linear]", pack: bool) -> None:
    """Move the fp32 CPU weights of ``layers`` into one huge-page buffer, one after another in
    the order given -- the order a decode step reads them, so the step streams one region
    (``kernels/huge_pages.py``) -- packing those ``pack_linear`` packs when ``pack``, keeping
    the others row-major. Layers of other methods (quantized) are left where they are. A layer
    whose weight was shared (a tied LM head and its embedding) gets a weight of its own: the
    caller re-ties."""
    plans = []                      # (layer, shape in the buffer, packed?)
    for layer in layers:
        if type(layer.method) is PackedLinearMethod:
            weight = layer.packed_weight
            plans.append((layer, tuple(weight.shape), True))
            continue
        if type(layer.method) is not UnquantizedLinearMethod:
            continue
        weight = layer.weight
        if weight.dtype != torch.float32 or not weight.is_cpu or not weight.is_contiguous():
            continue
        shape = packing_shape(layer) if pack else None
        plans.append((layer, shape or tuple(weight.shape), shape is not None))
    if not plans:
        return
    buffers = huge_page_zeros([shape for _, shape, _ in plans], torch.float32)
    for (layer, _, packed), buffer in zip(plans, buffers):
        if type(layer.method) is PackedLinearMethod:
            layer.packed_weight = nn.Parameter(buffer.copy_(layer.packed_weight),
                                               requires_grad=False)
        elif packed:
            pack_linear(layer, out=buffer)
        else:
            layer.weight = nn.Parameter(buffer.copy_(layer.weight), requires_grad=False)


class PackedRowsEmbedding(nn.Module):
    """The embedding table of a tied LM head whose weight is packed: row i of the head's
    [vocab, hidden] weight is token i's embedding, gathered from the packed layout
    (``packed[i // R, :, i % R, :]``), so the table is stored once, in the layout the head's
    kernel streams fastest."""

    def __init__(self, head: "Linear") -> None:
        super().__init__()
        if type(head.method) is not PackedLinearMethod:
            raise TypeError("PackedRowsEmbedding reads a packed linear layer's rows")
        self._head = (head,)          # a tuple: not registered as a submodule here
        self.num_embeddings, self.embedding_dim = head.output_size, head.input_size

    @property
    def weight(self) -> torch.Tensor:
        """The [vocab, hidden] table, unpacked (a new tensor)."""
        return PackedLinearMethod.dense_weight(self._head[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return kernel_ops.packed_rows(self._head[0].packed_weight, ids, self.num_embeddings)


def dense_weight(layer: "Linear") -> torch.Tensor:
    """A float layer's [out, in] weight, whichever float layout holds it."""
    if type(layer.method) is PackedLinearMethod:
        return PackedLinearMethod.dense_weight(layer)
    return layer.weight


class Linear(nn.Module):
    """``y = x W^T + b`` with storage and kernel delegated to ``method``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 method: LinearMethod | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        if input_size <= 0 or output_size <= 0:
            raise ValueError(f"linear sizes must be > 0, got input_size={input_size}, "
                             f"output_size={output_size}")
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, dtype, device)

    def load_weight(self, kind: str, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.output_size:
            raise ValueError(f"{kind} with {loaded.shape[0]} output rows loaded into a linear layer "
                             f"with output_size {self.output_size}")
        self.method.load_weight(self, kind, loaded, 0)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, "
                f"method={type(self.method).__name__}")


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul (q|k|v or gate|up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethod | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if not output_sizes or any(s <= 0 for s in output_sizes):
            raise ValueError(f"output_sizes must be non-empty and positive, got {output_sizes}")
        super().__init__(input_size, sum(output_sizes), bias, method, dtype, device)
        self.output_sizes = list(output_sizes)

    def load_shard(self, shard_id: int, kind: str, loaded: torch.Tensor) -> None:
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} shards")
        if loaded.shape[0] != self.output_sizes[shard_id]:
            raise ValueError(f"shard {shard_id} {kind} has {loaded.shape[0]} rows, expected "
                             f"{self.output_sizes[shard_id]}")
        offset = sum(self.output_sizes[:shard_id])
        self.method.load_weight(self, kind, loaded, offset)
