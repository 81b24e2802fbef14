"""Train a small masked-diffusion LM on the shipped text (``kvforge train-diffusion``).

Objective (LLaDA's pre-training loss): per sequence draw t ~ U(eps, 1], mask each token with
probability t, predict the masked tokens; loss = sum over masked of CE / t, divided by the token
count (an upper bound on the negative log-likelihood). Half the sequences keep a random prefix
unmasked, so the model also learns what generation asks of it: fill a canvas after a prompt.

Text: The Tempest and ShareGPT answers (``eval/corpus.py``), byte-level (``byte_tokenizer.py``),
the last ``HELD_OUT`` of each kept for the reported held-out loss.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.diffusion.byte_tokenizer import MASK_ID, VOCAB_SIZE
from kvforge.models.diffusion_config import DiffusionLMConfig
from kvforge.models.diffusion_lm import MaskedDiffusionLM

HELD_OUT = 0.05
MIN_MASK_RATE = 1e-3


@dataclass
class DiffusionTraining:
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 704
    seq_len: int = 256
    batch: int = 16
    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 100
    max_minutes: float = 30.0          # stop (and save) when the time is up, whatever the steps
    sharegpt_chars: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "seq_len",
                     "batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into num_heads "
                             f"{self.num_heads} heads of an even size")
        if not 0 < self.max_minutes:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")

    def model_config(self) -> DiffusionLMConfig:
        return DiffusionLMConfig("llada", vocab_size=VOCAB_SIZE, hidden_size=self.hidden_size,
                                 num_layers=self.num_layers, num_heads=self.num_heads,
                                 num_kv_heads=self.num_heads,
                                 intermediate_size=self.intermediate_size, mask_token_id=MASK_ID,
                                 max_position=1024, tie_word_embeddings=True,
                                 eos_token_ids=[256])


def corpus_splits(sharegpt_chars: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes) as int64 tensors: each text's last HELD_OUT held out."""
    from kvforge.eval.corpus import shakespeare_text, sharegpt_text
    train, held = [], []
    for text in (shakespeare_text(), sharegpt_text(max_chars=sharegpt_chars)):
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - HELD_OUT))
        train.append(data[:cut])
        held.append(data[cut:])
    return torch.cat(train), torch.cat(held)


def masked_batch(data: torch.Tensor, opts: DiffusionTraining, gen: torch.Generator):
    """(noisy ids, clean ids, mask rate per token) for ``opts.batch`` random windows."""
    starts = torch.randint(0, len(data) - opts.seq_len, (opts.batch,), generator=gen)
    clean = torch.stack([data[s:s + opts.seq_len] for s in starts.tolist()])
    t = (1 - MIN_MASK_RATE) * torch.rand(opts.batch, 1, generator=gen) + MIN_MASK_RATE
    rate = t.expand(-1, opts.seq_len)
    masked = torch.rand(clean.shape, generator=gen) < rate
    # half the rows: a prompt of random length that is never masked
    prompt = torch.randint(0, opts.seq_len // 2, (opts.batch, 1), generator=gen)
    prompted = torch.rand(opts.batch, 1, generator=gen) < 0.5
    masked &= ~(prompted & (torch.arange(opts.seq_len) < prompt))
    return torch.where(masked, MASK_ID, clean), clean, rate, masked


def diffusion_loss(model, noisy, clean, rate, masked) -> torch.Tensor:
    positions = torch.arange(noisy.shape[1]).expand_as(noisy)
    logits = model(noisy, positions)
    ce = F.cross_entropy(logits[masked], clean[masked], reduction="none")
    return (ce / rate[masked]).sum() / noisy.numel()


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, opts: DiffusionTraining, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)       # the same masks every time it is measured
    model.eval()
    total = sum(diffusion_loss(model, *masked_batch(data, opts, gen)).item()
                for _ in range(batches))
    model.train()
    return total / batches


def train(opts: DiffusionTraining, progress: bool = True) -> tuple[MaskedDiffusionLM, dict]:
    from tqdm import tqdm
    torch.manual_seed(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    train_data, held_data = corpus_splits(opts.sharegpt_chars)
    model = MaskedDiffusionLM(opts.model_config())
    model.init_weights(torch.Generator().manual_seed(opts.seed))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": other, "weight_decay": 0.0}],
                              lr=opts.lr, betas=(0.9, 0.95))
    before = held_out_loss(model, held_data, opts)
    t0 = time.perf_counter()
    deadline = t0 + opts.max_minutes * 60
    bar = tqdm(range(opts.steps), desc="train-diffusion", unit="step", disable=not progress)
    step, ema = 0, None
    for step in bar:
        if time.perf_counter() > deadline:
            break
        # cosine decay over whichever runs out first, steps or time: a run the time cap
        # stops (a busy machine) still ends annealed
        done = max(step / opts.steps, (time.perf_counter() - t0) / (deadline - t0))
        lr = opts.lr * min(1.0, (step + 1) / opts.warmup) * 0.5 * (1 + math.cos(math.pi * done))
        for group in optim.param_groups:
            group["lr"] = lr
        loss = diffusion_loss(model, *masked_batch(train_data, opts, gen))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}")
    else:
        step += 1
    bar.close()
    seconds = time.perf_counter() - t0
    after = held_out_loss(model, held_data, opts)
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    report = {"steps": step, "seconds": round(seconds, 1), "parameters": params,
              "train_bytes": len(train_data), "held_out_loss_before": round(before, 4),
              "held_out_loss_after": round(after, 4), "threads": torch.get_num_threads(),
              "corpus": "tempest+sharegpt (bytes)", "options": vars(opts)}
    return model, report
