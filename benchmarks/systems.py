"""The two systems under test behind one tiny interface: ``generate(requests) -> output lengths``.

Both get the same prompt token ids, greedy decoding, and exactly ``output_len`` new tokens per
request (EOS ignored), so their timings are of the same work.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvforge.bench.sharegpt import BenchRequest


class System(Protocol):
    name: str

    def generate(self, requests: list[BenchRequest]) -> list[int]:
        """Run every request to completion; return the number of useful output tokens of each."""
        ...


def default_gguf_path() -> Path:
    """The default SmolLM2 GGUF: the same file kvforge's ``LLM(model=None)`` loads."""
    from kvforge.loader.default_model import default_model_path
    return Path(default_model_path())


# ---------------------------------------------------------------------------------------------
class KvforgeSystem:
    name = "kvforge"

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        from kvforge import LLM, SamplingParams
        self._params_cls = SamplingParams
        self.llm = LLM(model=model, **engine_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.llm.tokenizer.encode(text))

    @property
    def model_config(self):
        return self.llm.model_config

    def generate(self, requests: list[BenchRequest]) -> list[int]:
        params = [self._params_cls(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in requests]
        outs = self.llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        return [min(len(o.outputs[0].token_ids), r.output_len) for o, r in zip(outs, requests)]


# ---------------------------------------------------------------------------------------------
def static_batches(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Consecutive batches in arrival order (what a plain HF generate loop does)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask with prompts right-aligned, so every row's next token is
    appended at the same column:

        [pad pad  a0 a1 a2]      mask [0 0 1 1 1]
        [ b0  b1  b2 b3 b4]           [1 1 1 1 1]
    """
    if not prompts or any(not p for p in prompts):
        raise ValueError("left_pad needs at least one prompt and no empty prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


class HFSystem:
    """HF transformers ``generate`` on static batches: the batch runs until its longest request
    is done; only each request's own target tokens count as useful output."""

    name = "HF transformers"

    def __init__(self, model: str | Path | None = None, batch_size: int = 16) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        path = Path(model) if model else default_gguf_path()
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        root = path.parent if path.suffix == ".gguf" else path
        self.tokenizer = AutoTokenizer.from_pretrained(root, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **kwargs).eval()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        cfg = self.model.config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.tokenizer.pad_token_id
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def model_config(self):
        return self.model.config

    @torch.inference_mode()
    def generate(self, requests: list[BenchRequest]) -> list[int]:
        counts: list[int] = []
        for batch in static_batches(requests, self.batch_size):
            input_ids, mask = left_pad([r.prompt_token_ids for r in batch], self.pad_id)
            max_new = max(r.output_len for r in batch)
            # min_new_tokens masks EOS, so every row runs the full max_new steps
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=max_new, min_new_tokens=max_new,
                                      pad_token_id=self.pad_id)
            produced = out.shape[1] - input_ids.shape[1]
            counts.extend(min(produced, r.output_len) for r in batch)
        return counts


# ---------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    system: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int          # useful output tokens (each request's own target at most)
    flops: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def mfu(self, peak_flops: float) -> float:
        return self.flops / self.elapsed_s / peak_flops

    def as_dict(self, peak_flops: float | None = None) -> dict:
        d = dict(vars(self), requests_per_s=self.requests_per_s,
                 output_tok_per_s=self.output_tok_per_s, total_tok_per_s=self.total_tok_per_s)
        if peak_flops:
            d["mfu"] = self.mfu(peak_flops)
        return d


def timed_run(system: System, requests: list[BenchRequest], shape=None) -> RunResult:
    """Run all requests once and time it. ``shape`` (a ModelShape) adds the useful FLOPs."""
    t0 = time.perf_counter()
    counts = system.generate(requests)
    elapsed = time.perf_counter() - t0
    if len(counts) != len(requests):
        raise RuntimeError(f"{system.name} returned {len(counts)} results for {len(requests)} requests")
    short = [(i, c, r.output_len) for i, (c, r) in enumerate(zip(counts, requests)) if c < r.output_len]
    if short:
        print(f"WARNING: {system.name} stopped {len(short)} requests early, e.g. (index, got, "
              f"wanted) {short[:3]}; only produced tokens are counted")
    flops = sum(shape.request_flops(r.prompt_len, c) for r, c in zip(requests, counts) if c) if shape else 0.0
    return RunResult(system.name, len(requests), elapsed, sum(r.prompt_len for r in requests),
                     sum(counts), flops)
