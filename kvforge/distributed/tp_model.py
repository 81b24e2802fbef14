"""A rank's slice of a Llama-family model: sharded loading and the collectives in its forward.

The slice is an ordinary ``LlamaForCausalLM`` built from ``TensorParallelPlan.local_config``
(fewer heads, narrower MLP, a vocabulary shard), fed the matching slices of the checkpoint's
tensors; what makes the ranks one model is added around its modules:

    embed_tokens   VocabParallelEmbedding: rows outside the shard are zero, then all-reduce
    o_proj, down   row-parallel: a forward hook all-reduces the partial sums (their biases
                   live on rank 0 only, so they are added once)
    lm_head        a forward hook all-gathers the shards' logits into [T, vocab]

Every rank ends each layer with the same hidden states, so sampling needs rank 0 alone.

A GGUF file under ``--quantization auto`` (or ``gguf``) is sliced in its own blocks, as one
process runs it (quant/gguf.py): row slices are views of the memory map; the row-parallel
``o_proj`` / ``down_proj`` slices copy whole blocks of each row, so the plan cuts the MLP only
at block boundaries (``column_block``). A rank's integer dot products are then exactly one
process's, block for block; only the all-reduce adds the partial sums in another order.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator

import torch
from torch import nn

from kvforge.distributed.comm import CommGroup
from kvforge.distributed.tp_plan import TensorParallelPlan
from kvforge.loader.source import ModelSource
from kvforge.quant.gguf import GGUFBlocks, block_columns
from kvforge.quant.loading import auto_quantization, load_model

logger = logging.getLogger(__name__)


def tensor_parallel_quantization(quantization: str | None, source: ModelSource,
                                 dtype: torch.dtype, device: torch.device | str) -> str:
    """What the slices run: "gguf" (a GGUF file's own blocks) or "none" (float weights).
    ``distributed/config.py`` has refused every other method already."""
    if quantization == "auto":
        return auto_quantization(source, dtype, device)
    return "gguf" if quantization == "gguf" else "none"


def column_block(source: ModelSource, quantization: str) -> int:
    """Input columns per block of the MLP's row-parallel ``down_proj`` tensors (1 for float
    weights): the unit the plan cuts the intermediate size in."""
    if quantization != "gguf":
        return 1
    return max((block_columns(t.tensor_type.name) for t in source.gguf_reader().tensors
                if t.name.endswith("ffn_down.weight")), default=1)


def rank_plan(source: ModelSource, world_size: int, rank: int, quantization: str
              ) -> TensorParallelPlan:
    return TensorParallelPlan.for_rank(source.config, world_size, rank,
                                       intermediate_unit=column_block(source, quantization))


@dataclasses.dataclass
class ShardedModelSource(ModelSource):
    """A ``ModelSource`` whose config and tensors (float or GGUF blocks) are one rank's slice."""
    plan: TensorParallelPlan | None = None

    def select_weights(self, weights):
        return shard_weights(weights, self.plan)


def _rows(weight, rows: slice):
    return weight.row_slice(rows.start, rows.stop) if isinstance(weight, GGUFBlocks) \
        else weight[rows]


def _columns(weight, cols: slice):
    if not isinstance(weight, GGUFBlocks):
        return weight[:, cols]
    if weight.on_block_boundaries(cols.start, cols.stop):
        return weight.column_slice(cols.start, cols.stop)
    # heads that end inside a block (the plan aligns only the MLP): this slice runs in fp32
    logger.warning("tensor parallel: columns [%d, %d) of %s cut its %s blocks; that slice "
                   "runs dequantized to fp32", cols.start, cols.stop, weight.name,
                   weight.type_name)
    return GGUFBlocks.from_float(weight.dequantize()[:, cols], f"{weight.name}[:, {cols}]")


def _vocab_rows(weight, plan: TensorParallelPlan):
    """Rows [vocab_start, vocab_start + vocab_shard), the last rank's padded with zeros."""
    rows = _rows(weight, slice(plan.vocab_start, plan.vocab_start + plan.vocab_shard))
    if isinstance(rows, GGUFBlocks):
        return rows.zero_padded(plan.vocab_shard)
    padded = torch.zeros(plan.vocab_shard, weight.shape[1], dtype=weight.dtype)
    padded[: rows.shape[0]] = rows
    return padded


def shard_weights(weights, plan: TensorParallelPlan) -> Iterator[tuple[str, object]]:
    """HF-named full weights (float tensors or ``GGUFBlocks``) -> this rank's slices (norms
    and other tensors whole)."""
    d = plan.head_dim
    q = slice(plan.q_heads.start * d, plan.q_heads.stop * d)
    kv = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
    inter = slice(plan.intermediate.start, plan.intermediate.stop)
    for name, weight in weights:
        module_path, _, kind = name.rpartition(".")
        proj = module_path.rpartition(".")[2]
        if proj == "q_proj":
            weight = _rows(weight, q)
        elif proj in ("k_proj", "v_proj"):
            weight = _rows(weight, kv)
        elif proj in ("gate_proj", "up_proj"):
            weight = _rows(weight, inter)
        elif proj in ("o_proj", "down_proj"):
            if kind == "weight":
                weight = _columns(weight, q if proj == "o_proj" else inter)
            elif plan.rank != 0:
                weight = torch.zeros_like(weight)     # added once, after the all-reduce
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weight = _vocab_rows(weight, plan)
        yield name, weight if isinstance(weight, GGUFBlocks) else weight.contiguous()


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the table (any embedding module: a float table, GGUF
    blocks, a packed head's rows); a token elsewhere embeds as zeros here and the all-reduce
    adds the rank that holds it."""

    def __init__(self, table: nn.Module, start: int, rows: int, comm: CommGroup) -> None:
        super().__init__()
        self.table, self.start, self.rows, self.comm = table, start, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.table(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0.0)
        return self.comm.all_reduce(out)


def load_tensor_parallel_model(source: ModelSource, plan: TensorParallelPlan, comm: CommGroup,
                               *, quantization: str, attn_backend: str, dtype: torch.dtype,
                               device: torch.device) -> nn.Module:
    """This rank's slice (``quantization`` from ``tensor_parallel_quantization``), loaded and
    wired for its collectives."""
    local = ShardedModelSource(config=plan.local_config(source.config), path=source.path,
                               format=source.format, _reader=source._reader, plan=plan)
    model = load_model(local, quantization=quantization, attn_backend=attn_backend, dtype=dtype,
                       device=device)
    if quantization == "none" and model.quant_config is not None:
        raise ValueError(f"{source.path!r} is a saved quantized model; tensor parallel runs "
                         f"float weights and GGUF files only")
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
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens,
                                                      plan.vocab_start, plan.vocab_shard, comm)

    def gather_logits(module, inputs, output):
        return torch.cat(comm.all_gather(output), dim=-1)[..., : plan.vocab_size]

    model.lm_head.register_forward_hook(gather_logits)
