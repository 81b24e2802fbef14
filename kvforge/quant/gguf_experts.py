"""A mixture of experts kept in the GGUF file's blocks (``--quantization gguf``).

llama.cpp stores each layer's experts stacked, ``blk.N.ffn_{gate,up,down}_exps`` [E, out, in];
the loader hands every expert its own rows of that tensor (``GGUFBlocks`` views of the memory
map, ``gguf_loader.split_experts``), and this method multiplies them with the same compiled
block kernels as a dense projection (``csrc/gguf_weight.cpp``):

    expert e:   x [n, H] --GgufWeight([gate_e, up_e])--> [n, 2I] --act--> --GgufWeight(down_e)--> [n, H]

Only the experts a batch routes to are read, so a decode step touches top_k of E experts'
bytes. Without the compiled kernels each expert is dequantized once (gguf-py) and runs in fp32.
"""
from __future__ import annotations

import torch

from kvforge.layers.moe import ExpertsMethod, check_expert_shape
from kvforge.quant.gguf import GGUFBlocks, blocks_multiply, blocks_weight


class GGUFExpertsMethod(ExpertsMethod):
    def create_weights(self, layer, dtype, device):
        if dtype != torch.float32 or torch.device(device).type not in ("cpu", "meta"):
            raise ValueError(f"GGUF experts run on fp32 CPU activations; got dtype {dtype}, "
                             f"device {device!r}")
        layer._gguf_expert_blocks = {}          # (expert, shard) -> GGUFBlocks

    def load_expert(self, layer, expert_id, shard, loaded):
        check_expert_shape(layer, expert_id, shard, loaded)
        if not isinstance(loaded, GGUFBlocks):
            loaded = GGUFBlocks.from_float(loaded, f"<expert {expert_id} {shard}>")
        layer._gguf_expert_blocks[(expert_id, shard)] = loaded

    def process_weights_after_loading(self, layer):
        blocks = layer._gguf_expert_blocks
        layer._gguf_w13 = [blocks_weight([blocks[(e, "gate")], blocks[(e, "up")]],
                                         layer.hidden_size) for e in range(layer.num_experts)]
        layer._gguf_w2 = [blocks_weight([blocks[(e, "down")]], layer.intermediate_size)
                          for e in range(layer.num_experts)]

    def expert_forward(self, layer, expert_id, x):
        gate_up = blocks_multiply(layer._gguf_w13[expert_id], x, None)
        return blocks_multiply(layer._gguf_w2[expert_id], layer.act_fn(gate_up), None)

    def dequantize(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Float (w13 [E, 2I, H], w2 [E, H, I]) by gguf-py: the reference the kernels match."""
        blocks = layer._gguf_expert_blocks
        w13 = [torch.cat([blocks[(e, "gate")].dequantize(), blocks[(e, "up")].dequantize()])
               for e in range(layer.num_experts)]
        w2 = [blocks[(e, "down")].dequantize() for e in range(layer.num_experts)]
        return torch.stack(w13), torch.stack(w2)
