"""Which canvas positions a diffusion generation fills, block by block, and how many per step.

    prompt (P tokens) | block 0 | block 1 | ... | last block (may be shorter)
                        <- B ->   <- B ->          <- G - (n-1)B ->

Blocks are filled left to right (semi-autoregressive); within a block the fixed schedule spreads
the block's masks evenly over ``steps // num_blocks`` steps, the first ``masks % steps`` steps
taking one more (LLaDA's ``get_num_transfer_tokens``). The threshold mode (Fast-dLLM) has no
step count: it runs until the block has no masks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockPlan:
    gen_length: int
    block_length: int
    steps_per_block: int

    @classmethod
    def for_request(cls, gen_length: int, block_length: int, steps: int | None) -> "BlockPlan":
        """``steps`` None: one token per step. Errors name the values."""
        block = min(block_length, gen_length)
        num_blocks = -(-gen_length // block)
        if steps is None:
            return cls(gen_length, block, block)     # a shorter last block skips its extra steps
        if steps > gen_length:
            raise ValueError(f"diffusion_steps ({steps}) must be <= max_tokens ({gen_length}): "
                             f"a step commits at least one token")
        if steps % num_blocks:
            raise ValueError(f"diffusion_steps ({steps}) must be a multiple of the number of "
                             f"blocks ({num_blocks} = ceil(max_tokens {gen_length} / "
                             f"diffusion_block_length {block}))")
        return cls(gen_length, block, steps // num_blocks)

    def blocks(self) -> list[tuple[int, int]]:
        """[start, end) of each block, relative to the end of the prompt."""
        return [(s, min(s + self.block_length, self.gen_length))
                for s in range(0, self.gen_length, self.block_length)]


def num_transfer_tokens(masked_counts: torch.Tensor, steps: int) -> torch.Tensor:
    """[B] masks in a block -> [B, steps] tokens to commit per step (sums to the counts)."""
    base = masked_counts // steps
    remainder = masked_counts % steps
    schedule = base.unsqueeze(1).repeat(1, steps)
    schedule += torch.arange(steps).unsqueeze(0) < remainder.unsqueeze(1)
    return schedule
