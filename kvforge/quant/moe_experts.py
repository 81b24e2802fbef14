"""Weight-only INT8 / INT4 MoE experts (``--quantization int8 | int4`` on Mixtral, Qwen2-MoE,
DeepSeek-V2): the ``ExpertsMethod`` side of the WINT8 / WINT4 schemes.

Storage per ``FusedMoE`` (E experts, hidden H, expert width I; rows of w13 = [gate (I) | up (I)]):

    int8   w13_q [E, 2I, H] int8   w13_s [E, 2I] bf16     W_e[n, :] ~= w13_q[e, n, :] * w13_s[e, n]
           w2_q  [E, H, I]  int8   w2_s  [E, H]  bf16     (per expert, per output channel)
    int4   w13_q [E, N13, Hp/2] uint8 kernel-packed, w13_sz [E, Hp/G, N13, 2] bf16 (scale, zero)
           w2_q  [E, N2, Ip/2]  uint8 kernel-packed, w2_sz  [E, Ip/G, N2, 2]  bf16
           (packing.py's format; Hp, Ip = H, I padded to whole groups of G; N13, N2 = 2I, H
           padded to the kernel's multiple of 16 rows, whose outputs are sliced off)

Forward: ``FusedMoE.experts_forward`` calls ``expert_forward(e, rows)`` only for the experts that
received tokens this step, and each call runs the dense layers' packed CPU kernels
(``torch._weight_int8pack_mm`` / ``torch._weight_int4pack_mm_for_cpu``, bf16 activations) on
expert e's slice of the stacked codes: no expert is ever dequantized. The gated activation runs
in fp32 between the two matmuls.

Loading: rows are independent, so INT8 quantizes each HF shard as it arrives. INT4 stages an
expert's codes until its gate and up rows (or its down rows) are in, then packs them; float
tensors, ``Int8Rows`` / ``Int4Blocks`` (a saved model's codes) are all accepted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.layers.moe import ExpertsMethod, FusedMoE, check_expert_shape
from kvforge.quant import packing
from kvforge.quant.int4 import Int4Blocks
from kvforge.quant.int8 import Int8Rows


def _check_cpu(device, scheme: str) -> None:
    if torch.device(device).type not in ("cpu", "meta"):
        raise ValueError(f"{scheme} experts run on PyTorch's CPU kernels; device {device!r} is "
                         f"not supported")


class Int8ExpertsMethod(ExpertsMethod):
    def create_weights(self, layer, dtype, device):
        _check_cpu(device, "int8")
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
        for name, shape in (("w13_q", (e, 2 * i, h)), ("w2_q", (e, h, i))):
            setattr(layer, name, nn.Parameter(torch.zeros(shape, dtype=torch.int8, device=device),
                                              requires_grad=False))
        for name, shape in (("w13_s", (e, 2 * i)), ("w2_s", (e, h))):
            setattr(layer, name, nn.Parameter(
                torch.zeros(shape, dtype=packing.SCALE_DTYPE, device=device), requires_grad=False))
        layer.out_dtype = dtype

    def load_expert(self, layer, expert_id, shard, loaded):
        check_expert_shape(layer, expert_id, shard, loaded)
        if isinstance(loaded, Int8Rows):
            q, scale = loaded.q, loaded.scale
        else:
            q, scale = packing.quantize_int8_per_channel(loaded)
        i = layer.intermediate_size
        if shard == "down":
            layer.w2_q[expert_id], layer.w2_s[expert_id] = q, scale.to(packing.SCALE_DTYPE)
        else:
            rows = slice(0, i) if shard == "gate" else slice(i, 2 * i)
            layer.w13_q[expert_id, rows] = q
            layer.w13_s[expert_id, rows] = scale.to(packing.SCALE_DTYPE)

    def expert_forward(self, layer, expert_id, x):
        gate_up = torch._weight_int8pack_mm(x.to(torch.bfloat16), layer.w13_q[expert_id],
                                            layer.w13_s[expert_id])
        act = layer.act_fn(gate_up.float()).to(torch.bfloat16)
        return torch._weight_int8pack_mm(act, layer.w2_q[expert_id],
                                         layer.w2_s[expert_id]).to(x.dtype)

    def export_expert(self, layer, expert_id: int, shard: str) -> Int8Rows:
        """One expert's HF shard ("gate" | "up" | "down") as saved rows."""
        if shard == "down":
            return Int8Rows(layer.w2_q[expert_id], layer.w2_s[expert_id])
        i = layer.intermediate_size
        rows = slice(0, i) if shard == "gate" else slice(i, 2 * i)
        return Int8Rows(layer.w13_q[expert_id, rows], layer.w13_s[expert_id, rows])

    def dequantize(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Float (w13 [E, 2I, H], w2 [E, H, I]): the reference the kernels must match."""
        return (layer.w13_q.float() * layer.w13_s.float()[..., None],
                layer.w2_q.float() * layer.w2_s.float()[..., None])


class Int4ExpertsMethod(ExpertsMethod):
    def __init__(self, group_size: int = 64) -> None:
        self.group_size = packing.check_int4_group_size(group_size)

    def create_weights(self, layer, dtype, device):
        _check_cpu(device, "int4")
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_size, self.group_size
        layer.padded_hidden = packing.padded_in_features(h, g)
        layer.padded_inter = packing.padded_in_features(i, g)
        n13, n2 = packing.padded_out_features(2 * i), packing.padded_out_features(h)
        shapes = {"w13_q": ((e, n13, layer.padded_hidden // 2), torch.uint8),
                  "w13_sz": ((e, layer.padded_hidden // g, n13, 2), packing.SCALE_DTYPE),
                  "w2_q": ((e, n2, layer.padded_inter // 2), torch.uint8),
                  "w2_sz": ((e, layer.padded_inter // g, n2, 2), packing.SCALE_DTYPE)}
        for name, (shape, dt) in shapes.items():
            setattr(layer, name, nn.Parameter(torch.zeros(shape, dtype=dt, device=device),
                                              requires_grad=False))
        layer._int4_staging = {}     # expert -> {shard: Int4Blocks} until gate+up (or down) are in
        layer.out_dtype = dtype

    def load_expert(self, layer, expert_id, shard, loaded):
        check_expert_shape(layer, expert_id, shard, loaded)
        if isinstance(loaded, Int4Blocks):
            if loaded.group_size != self.group_size:
                raise ValueError(f"int4 blocks with group {loaded.group_size} do not fit experts "
                                 f"quantized with group {self.group_size}")
            blocks = loaded
        else:
            codes, scale, zero = packing.quantize_int4_groupwise(loaded, self.group_size)
            blocks = Int4Blocks(codes, scale, zero, loaded.shape[1])
        staged = layer._int4_staging.setdefault(expert_id, {})
        staged[shard] = blocks
        if shard == "down":
            self._pack(layer.w2_q, layer.w2_sz, expert_id, [staged.pop("down")])
        elif "gate" in staged and "up" in staged:
            self._pack(layer.w13_q, layer.w13_sz, expert_id, [staged.pop("gate"), staged.pop("up")])
        if not staged:
            del layer._int4_staging[expert_id]

    @staticmethod
    def _pack(q: torch.Tensor, sz: torch.Tensor, expert_id: int, parts: list[Int4Blocks]) -> None:
        codes = torch.cat([b.codes for b in parts])
        q[expert_id] = packing.pack_int4_kernel(codes)
        # kernel wants [groups, Np, 2]: (scale, zero) for group g of output row n (rows padded
        # to the kernel's multiple of 16 keep scale 0, zero 0)
        sz[expert_id, :, :codes.shape[0]] = torch.stack(
            [torch.cat([b.scale for b in parts]).t(), torch.cat([b.zero for b in parts]).t()],
            dim=-1)

    def process_weights_after_loading(self, layer):
        if layer._int4_staging:
            pending = sorted((e, s) for e, shards in layer._int4_staging.items() for s in shards)
            raise ValueError(f"int4 experts missing the partner shard of (expert, shard) "
                             f"{pending[:6]}")

    def expert_forward(self, layer, expert_id, x):
        g = self.group_size
        xb = x.to(torch.bfloat16)
        if layer.padded_hidden != layer.hidden_size:
            xb = F.pad(xb, (0, layer.padded_hidden - layer.hidden_size))
        gate_up = torch._weight_int4pack_mm_for_cpu(xb, layer.w13_q[expert_id], g,
                                                    layer.w13_sz[expert_id])
        act = layer.act_fn(gate_up[:, :2 * layer.intermediate_size].float()).to(torch.bfloat16)
        if layer.padded_inter != layer.intermediate_size:
            act = F.pad(act, (0, layer.padded_inter - layer.intermediate_size))
        out = torch._weight_int4pack_mm_for_cpu(act, layer.w2_q[expert_id], g,
                                                layer.w2_sz[expert_id])
        return out[:, :layer.hidden_size].to(x.dtype)

    def _blocks(self, q, sz, expert_id, n, k_padded, k) -> Int4Blocks:
        codes = packing.unpack_int4_kernel(q[expert_id], n, k_padded)
        return Int4Blocks(codes, sz[expert_id, :, :n, 0].t().contiguous(),
                          sz[expert_id, :, :n, 1].t().contiguous(), k)

    def export_expert(self, layer, expert_id: int, shard: str) -> Int4Blocks:
        h, i = layer.hidden_size, layer.intermediate_size
        if shard == "down":
            return self._blocks(layer.w2_q, layer.w2_sz, expert_id, h, layer.padded_inter, i)
        b = self._blocks(layer.w13_q, layer.w13_sz, expert_id, 2 * i, layer.padded_hidden, h)
        rows = slice(0, i) if shard == "gate" else slice(i, 2 * i)
        return Int4Blocks(b.codes[rows], b.scale[rows], b.zero[rows], h)

    def dequantize(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = [], []
        for e in range(layer.num_experts):
            parts = [self.export_expert(layer, e, s) for s in ("gate", "up", "down")]
            deq = [packing.dequantize_int4(b.codes, b.scale, b.zero, b.in_features) for b in parts]
            w13.append(torch.cat(deq[:2]))
            w2.append(deq[2])
        return torch.stack(w13), torch.stack(w2)


def replace_experts_method(layer: FusedMoE, method: ExpertsMethod) -> None:
    """Give a freshly built ``FusedMoE`` another storage (before any weight is loaded)."""
    first = next(iter(layer._parameters.values()), None)
    dtype = first.dtype if first is not None else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    for name in list(layer._parameters):
        del layer._parameters[name]
    layer.method = method
    method.create_weights(layer, dtype, device)
