"""Which slice of a Llama-family or Gemma 3 model one tensor-parallel rank holds (Megatron layout).

    q|k|v, gate|up   column-parallel: rank r holds its heads' / its intermediate rows
    o, down          row-parallel: the matching input columns; partial sums all-reduced
    embedding        vocab-parallel: rows [r * S, (r + 1) * S), S = ceil(vocab / N), zero-padded
    LM head          the same rows; the ranks' logits all-gathered

Heads go to ranks as whole GQA groups (a KV head and its query heads), contiguous and as even
as the counts allow (SmolLM2's 3 KV heads on 2 ranks: 2 + 1). With fewer KV heads than ranks
each KV head is replicated on N / KV ranks, which split its query heads between them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvforge.models.config import ModelConfig

# families with Llama's projections (q|k|v, o, gate|up, down; models/registry.py names).
# Gemma 3's extra parts stay whole on every rank: its per-head q/k norms act on a rank's own
# heads, its post-attention / post-FFN norms and the embedding scale act on the all-reduced
# hidden state, the logit soft-cap on the gathered logits
TP_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                              "Gemma3ForCausalLM", "llama", "mistral", "qwen2", "gemma3"})


def even_range(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``n`` items cut into ``parts`` contiguous parts differing by at most one
    (the first ``n % parts`` parts one longer)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


@dataclass(frozen=True)
class TensorParallelPlan:
    rank: int
    world_size: int
    head_dim: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab_size: int                  # the full vocabulary
    vocab_shard: int                 # rows each rank holds (the last rank's padded with zeros)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    @classmethod
    def for_rank(cls, config: ModelConfig, world_size: int, rank: int,
                 intermediate_unit: int = 1) -> "TensorParallelPlan":
        """``intermediate_unit``: the MLP is cut only at multiples of it (the block size of a
        GGUF ``down_proj``, whose input columns the ranks split: a block is never cut)."""
        check_tensor_parallel_model(config, world_size, intermediate_unit)
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        group = heads // kv
        if kv >= world_size:
            kv_heads = even_range(kv, world_size, rank)
            q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        else:
            replicas = world_size // kv
            kv_index, part = divmod(rank, replicas)
            kv_heads = range(kv_index, kv_index + 1)
            per = group // replicas
            start = kv_index * group + part * per
            q_heads = range(start, start + per)
        return cls(rank=rank, world_size=world_size, head_dim=config.head_dim,
                   q_heads=q_heads, kv_heads=kv_heads,
                   intermediate=_unit_range(config.intermediate_size, intermediate_unit,
                                            world_size, rank),
                   vocab_size=config.vocab_size,
                   vocab_shard=-(-config.vocab_size // world_size))

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: a Llama with fewer heads, a narrower MLP and a
        vocabulary of ``vocab_shard`` rows (head_dim stays the full model's)."""
        return dataclasses.replace(
            config, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
            head_dim=self.head_dim, intermediate_size=len(self.intermediate),
            vocab_size=self.vocab_shard)


def _unit_range(n: int, unit: int, parts: int, i: int) -> range:
    """Part ``i`` of ``n`` items cut into ``parts`` runs of whole ``unit``s (the last unit may
    be short), as even as the units allow: 8960 = 35 blocks of 256 on 2 ranks -> 4608 + 4352."""
    units = even_range(-(-n // unit), parts, i)
    return range(units.start * unit, min(units.stop * unit, n))


def check_tensor_parallel_model(config: ModelConfig, world_size: int,
                                intermediate_unit: int = 1) -> None:
    """ValueError naming what does not split ``world_size`` ways."""
    if config.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"tensor parallel supports the Llama family, Qwen2 and Gemma 3 "
                         f"({', '.join(sorted(TP_ARCHITECTURES))}); {config.architecture!r} "
                         f"is not supported yet: use tensor_parallel_size=1")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if kv < world_size:
        if world_size % kv or (heads // kv) % (world_size // kv):
            raise ValueError(
                f"tensor_parallel_size {world_size} does not split the model's {kv} KV heads: "
                f"with more ranks than KV heads, it must be a multiple of them and each KV "
                f"head's {heads // kv} query heads must split evenly over {world_size // kv} ranks")
    if -(-config.intermediate_size // intermediate_unit) < world_size:
        raise ValueError(f"intermediate_size {config.intermediate_size} has fewer than "
                         f"tensor_parallel_size {world_size} units of {intermediate_unit} "
                         f"to split")
