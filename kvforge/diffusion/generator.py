"""The masked-diffusion generation loop over a batch of prompts (one SamplingParams).

    canvas row b:  [pad .. pad | prompt_b | mask x G]        (prompts left-padded to P)
    for each block [s, e) of the G positions:
        step 0         full forward; with a cache it is the refresh (K/V of every position)
        step 1, 2, ..  none:   full forward
                       prefix: forward of [s, L) over the cached K/V of [0, s)
                       dual:   forward of [s, e) over the cached K/V of [0, s) and [e, L)
        each step      x0 and confidence for the block's masks (sampling.py); commit the
                       scheduled count or, with a threshold, every position above it
Dream-layout models predict position i from the output at i - 1, so their query spans start one
earlier. Padding is hidden from every query by a key mask; positions count from each row's
first prompt token, so a padded row sees what it would see alone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvforge.diffusion.sampling import propose, select_commits
from kvforge.diffusion.schedule import BlockPlan, num_transfer_tokens
from kvforge.models.diffusion_lm import DiffusionKVCache, MaskedDiffusionLM
from kvforge.sampling_params import SamplingParams


@dataclass
class DiffusionStats:
    forwards: int = 0              # model calls
    query_tokens: int = 0          # positions those calls computed (batch rows included)
    seconds: float = 0.0


@dataclass
class DiffusionResult:
    token_ids: list[list[int]]     # the G canvas tokens of each prompt, no truncation
    stats: DiffusionStats


class DiffusionGenerator:
    def __init__(self, model: MaskedDiffusionLM) -> None:
        self.model = model
        self.mask_id = model.config.mask_token_id
        self.shift = model.config.logits_shift

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 generators: list[torch.Generator | None] | None = None) -> DiffusionResult:
        """Every block of a batch, start to end."""
        batch = self.start(prompts, params, generators)
        while not batch.done:
            batch.run_block()
        return DiffusionResult(batch.tokens(), batch.stats)

    def start(self, prompts: list[list[int]], params: SamplingParams,
              generators: list[torch.Generator | None] | None = None) -> "DiffusionBatch":
        """A batch to advance block by block (the engine streams each finished block)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("diffusion generation needs at least one non-empty prompt")
        plan = BlockPlan.for_request(params.max_tokens, params.diffusion_block_length,
                                     params.diffusion_steps)
        return DiffusionBatch(self, prompts, params, plan, generators or [None] * len(prompts))

    def _canvas(self, prompts: list[list[int]], gen_length: int):
        """Left-padded canvas [B, P + G], per-row positions, the key mask (None without
        padding) and P."""
        width = max(len(p) for p in prompts)
        total = width + gen_length
        canvas = torch.full((len(prompts), total), self.mask_id, dtype=torch.long)
        pads = torch.tensor([width - len(p) for p in prompts])
        for row, prompt in enumerate(prompts):
            canvas[row, pads[row]:width] = torch.tensor(prompt, dtype=torch.long)
        if total > self.model.config.max_position:
            raise ValueError(f"prompt ({width}) + max_tokens ({gen_length}) = {total} exceeds "
                             f"the model's {self.model.config.max_position} positions")
        columns = torch.arange(total).unsqueeze(0)
        positions = (columns - pads.unsqueeze(1)).clamp_min(0)
        key_mask = None
        if pads.any():
            key_mask = (columns >= pads.unsqueeze(1))[:, None, None, :]
        return canvas, positions, key_mask, width

    def _block_logits(self, canvas, positions, key_mask, cache, s, e, mode, refresh, stats):
        """Logits predicting canvas positions [s, e), [B, e - s, V]."""
        shift = self.shift
        if cache is None or refresh:
            # whole canvas; only the rows predicting the block go through the LM head
            q_start, q_end = 0, canvas.shape[1]
        else:
            q_start, q_end = s - shift, (canvas.shape[1] if mode == "prefix" else e)
        rows = slice(s - shift - q_start, e - shift - q_start)
        logits = self.model(canvas[:, q_start:q_end], positions[:, q_start:q_end], key_mask,
                            cache=cache, start=q_start, refresh=refresh, logit_rows=rows)
        stats.forwards += 1
        stats.query_tokens += canvas.shape[0] * (q_end - q_start)
        return logits


class DiffusionBatch:
    """One batch's canvas, cache and progress; ``run_block`` fills the next block."""

    def __init__(self, gen: DiffusionGenerator, prompts: list[list[int]], params: SamplingParams,
                 plan: BlockPlan, generators: list[torch.Generator | None]) -> None:
        self.gen, self.params, self.plan, self.generators = gen, params, plan, generators
        self.stats = DiffusionStats()
        self.canvas, self.positions, self.key_mask, self.start = gen._canvas(prompts,
                                                                            plan.gen_length)
        self.cache = None if params.diffusion_cache == "none" else DiffusionKVCache(
            gen.model.config.num_layers)
        self.blocks = plan.blocks()
        self.num_done = 0              # blocks filled
        self.committed = 0             # canvas tokens final, from the prompt's end

    @property
    def done(self) -> bool:
        return self.num_done == len(self.blocks)

    def tokens(self) -> list[list[int]]:
        """The committed tokens of each row (all G once done)."""
        return self.canvas[:, self.start:self.start + self.committed].tolist()

    @torch.inference_mode()
    def run_block(self) -> None:
        t0 = time.perf_counter()
        gen, params, plan = self.gen, self.params, self.plan
        block_start, block_end = self.blocks[self.num_done]
        s, e = self.start + block_start, self.start + block_end
        canvas = self.canvas
        masked = canvas[:, s:e] == gen.mask_id
        schedule = (None if params.parallel_threshold is not None
                    else num_transfer_tokens(masked.sum(1), plan.steps_per_block))
        step, refreshed = 0, False
        while masked.any() and (schedule is None or step < plan.steps_per_block):
            counts = None if schedule is None else schedule[:, step]
            if counts is None or counts.any():
                logits = gen._block_logits(canvas, self.positions, self.key_mask, self.cache, s,
                                           e, params.diffusion_cache, refresh=not refreshed,
                                           stats=self.stats)
                refreshed = True
                x0, confidence = propose(logits, params.temperature, params.remasking,
                                         self.generators, gen.mask_id)
                commit = select_commits(confidence, masked, counts, params.parallel_threshold)
                canvas[:, s:e] = torch.where(commit, x0, canvas[:, s:e])
                masked = canvas[:, s:e] == gen.mask_id
            step += 1
        self.num_done += 1
        self.committed = block_end
        self.stats.seconds += time.perf_counter() - t0
