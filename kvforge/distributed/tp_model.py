"""A rank's slice of a Llama-family model: sharded loading and the collectives in its forward.

The slice is an ordinary ``LlamaForCausalLM`` built from ``TensorParallelPlan.local_config``
(fewer heads, narrower MLP, a vocabulary shard), fed the matching slices of the checkpoint's
tensors; what makes the ranks one model is added around its modules:

    embed_tokens   VocabParallelEmbedding: rows outside the shard are zero, then all-reduce
    o_proj, down   row-parallel: a forward hook all-reduces the partial sums (their biases
                   live on rank 0 only, so they are added once)
    lm_head        a forward hook all-gathers the shards' logits into [T, vocab]

Every rank ends each layer with the same hidden states, so sampling needs rank 0 alone.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn

from kvforge.distributed.comm import CommGroup
from kvforge.distributed.tp_plan import TensorParallelPlan
from kvforge.loader.source import ModelSource
from kvforge.quant.loading import load_model


@dataclasses.dataclass
class ShardedModelSource(ModelSource):
    """A ``ModelSource`` whose config and tensors are one rank's slice."""
    full: ModelSource | None = None
    plan: TensorParallelPlan | None = None

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return shard_weights(self.full.iter_weights(), self.plan)


def shard_weights(weights, plan: TensorParallelPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors -> this rank's slices (norms and other tensors whole)."""
    d = plan.head_dim
    q = slice(plan.q_heads.start * d, plan.q_heads.stop * d)
    kv = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
    inter = slice(plan.intermediate.start, plan.intermediate.stop)
    for name, tensor in weights:
        module_path, _, kind = name.rpartition(".")
        proj = module_path.rpartition(".")[2]
        if proj == "q_proj":
            tensor = tensor[q]
        elif proj in ("k_proj", "v_proj"):
            tensor = tensor[kv]
        elif proj in ("gate_proj", "up_proj"):
            tensor = tensor[inter]
        elif proj in ("o_proj", "down_proj"):
            cols = q if proj == "o_proj" else inter
            if kind == "weight":
                tensor = tensor[:, cols]
            elif plan.rank != 0:
                tensor = torch.zeros_like(tensor)     # added once, after the all-reduce
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[plan.vocab_start: plan.vocab_start + plan.vocab_shard]
            tensor = torch.zeros(plan.vocab_shard, tensor.shape[1], dtype=tensor.dtype)
            tensor[: rows.shape[0]] = rows
        yield name, tensor.contiguous()


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the table; a token elsewhere embeds as zeros here and
    the all-reduce adds the rank that holds it."""

    def __init__(self, weight: nn.Parameter, start: int, comm: CommGroup) -> None:
        super().__init__()
        self.weight, self.start, self.comm = weight, start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.comm.all_reduce(out)


def load_tensor_parallel_model(source: ModelSource, plan: TensorParallelPlan, comm: CommGroup,
                               *, attn_backend: str, dtype: torch.dtype,
                               device: torch.device) -> nn.Module:
    """This rank's slice, loaded and wired for its collectives."""
    local = ShardedModelSource(config=plan.local_config(source.config), path=source.path,
                               format=source.format, _reader=source._reader, full=source,
                               plan=plan)
    model = load_model(local, quantization="none", attn_backend=attn_backend, dtype=dtype,
                       device=device)
    if model.quant_config is not None:
        raise ValueError(f"{source.path!r} is a saved quantized model; tensor parallel runs "
                         f"float weights only")
    model.eval()
    parallelize(model, plan, comm)
    return model


def parallelize(model: nn.Module, plan: TensorParallelPlan, comm: CommGroup) -> None:
    # the compiled whole-step decode (kernels/decode_stack.py) has no collectives: a slice
    # runs the Python layers
    model._decode_stack, model._decode_stack_built = None, True

    def all_reduce_output(module, inputs, output):
        return comm.all_reduce(output)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(all_reduce_output)
        layer.mlp.down_proj.register_forward_hook(all_reduce_output)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight,
                                                      plan.vocab_start, comm)

    def gather_logits(module, inputs, output):
        return torch.cat(comm.all_gather(output), dim=-1)[..., : plan.vocab_size]

    model.lm_head.register_forward_hook(gather_logits)
