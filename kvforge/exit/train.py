"""Distil exit heads from the model's own final layer (LITE's objective, KL only).

    text (The Tempest past the eval's tokens + ShareGPT answers)
      -> prefills of WINDOW tokens through the fp32 Python layers; hooks keep the residual
         stream after each exit layer E and the final-normed hidden state  [N, d] each
      -> per batch of tokens: teacher p = softmax(lm_head(final)),
         student q_E = softmax(lm_head(head_E(stream_E))), loss = sum_E KL(p || q_E)

Only the heads learn (Adam, cosine decay); the LM head and the decoder are frozen. Hidden states
are collected once and cached in memory (N x d per exit layer, ~2.4 MB per 1,024 tokens of a
576-wide model), the teacher's logits recomputed per batch: a full-vocabulary distribution per
token would not fit, and one LM-head product costs what the student's does.

Why the fp32 forward (``quantization none``): the GGUF weights dequantized exactly, prefills run
as large matmuls (the fast path for training data), and the Python layers take hooks; the heads
then serve the native path too (they read a residual stream that differs only by rounding).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvforge.attention.metadata import AttentionMetadata
from kvforge.exit.heads import ExitHeads
from kvforge.models.layerwise import CachedLayers, layerwise_family, stream_of

TEMPEST_OFFSET = 4096   # tokens of The Tempest that `kvforge eval perplexity` scores by default
WINDOW = 512
HELD_OUT = 0.1          # a seeded random tenth of the tokens: agreement measured there only


@dataclass
class ExitTraining:
    # training tokens (half The Tempest, half ShareGPT), seen once: with 16k tokens x 2 epochs a
    # 576 x 576 adapter overfit (held-out KL ~2x the training KL) for the same step count
    tokens: int = 32768
    epochs: int = 1
    batch: int = 128         # tokens per step
    lr: float = 1e-3
    seed: int = 0


def training_tokens(tokenizer, count: int) -> list[int]:
    """``count`` ids: The Tempest after the eval's first tokens, then ShareGPT answers."""
    from kvforge.eval.corpus import shakespeare_text, sharegpt_text
    tempest = tokenizer.encode(shakespeare_text(), add_special_tokens=False)[TEMPEST_OFFSET:]
    ids = tempest[:count // 2]
    chars = 6 * (count - len(ids))          # ~4 chars per token, with room to spare
    chat = tokenizer.encode(sharegpt_text(max_chars=chars), add_special_tokens=False)
    return ids + chat[:count - len(ids)]


@torch.inference_mode()
def collect_streams(model, ids: list[int], layers: list[int], window: int = WINDOW,
                    progress: bool = True) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """({E: residual stream after layer E [N, d]}, final-normed hidden [N, d]) over ``ids`` cut
    into independent windows (each a fresh sequence from position 0), the layers run one by
    one (models/layerwise.py: the Python layers, whatever the compiled decode stack takes)."""
    from tqdm import tqdm
    run = CachedLayers(model, "exit-head training")
    streams: dict[int, list[torch.Tensor]] = {e: [] for e in layers}
    finals = []
    block = 16
    for start in tqdm(range(0, len(ids), window), desc="hidden states", unit="window",
                      disable=not progress):
        piece = torch.tensor(ids[start:start + window])
        blocks = -(-len(piece) // block)
        meta = AttentionMetadata.build([len(piece)], [0], [list(range(blocks))], block,
                                       piece.device)
        hidden = run.embed(piece)
        rope = run.rope(meta.positions(), hidden.dtype)
        residual = None
        for j in range(model.num_layers):
            cache = torch.zeros(model.kv_cache_shape(blocks, block), dtype=model.kv_cache_dtype())
            hidden, residual = run.layer(j, hidden, residual, rope[j], cache, meta)
            if j + 1 in streams:
                streams[j + 1].append(stream_of(hidden, residual).float())
        finals.append(run.final_norm(hidden, residual).float())
    return {e: torch.cat(v) for e, v in streams.items()}, torch.cat(finals)


def lm_head_weight(model) -> torch.Tensor:
    """The LM head as a plain fp32 [vocab, d] tensor (the model loaded without quantization)."""
    w = getattr(model.lm_head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError("training exit heads needs the fp32 LM head: load the model with "
                         "quantization none")
    return w[:model.config.vocab_size]


def lm_logits(model):
    """z [N, d] -> the model's logits [N, vocab] through its fp32 LM head (Gemma 3: then its
    soft-cap, where the config sets one)."""
    head_w = lm_head_weight(model)
    family = layerwise_family(type(model), "exit-head training")
    return lambda z: family.logits(model, F.linear(z, head_w))


def train_heads(model, heads: ExitHeads, streams: dict[int, torch.Tensor], final: torch.Tensor,
                opts: ExitTraining, progress: bool = True) -> dict:
    """Train ``heads`` in place; returns per-layer held-out KL and top-1 agreement with the
    full model, before and after."""
    from tqdm import tqdm
    logits_of = lm_logits(model)
    n = final.shape[0]
    gen = torch.Generator().manual_seed(opts.seed)
    split = torch.randperm(n, generator=gen)
    n_held = min(n - 1, max(1, int(n * HELD_OUT))) if n > 1 else 0
    held, train = split[:n_held], split[n_held:]
    n_train = len(train)
    heads.requires_grad_(True)
    opt = torch.optim.Adam(heads.parameters(), lr=opts.lr)
    steps = max(1, opts.epochs * math.ceil(n_train / opts.batch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    before = evaluate(heads, streams, final, logits_of, held)
    bar = tqdm(total=steps, desc="exit heads", unit="step", disable=not progress)
    t0 = time.perf_counter()
    for _ in range(opts.epochs):
        order = train[torch.randperm(n_train, generator=gen)]
        for i in range(0, n_train, opts.batch):
            rows = order[i:i + opts.batch]
            with torch.no_grad():
                teacher = F.log_softmax(logits_of(final[rows]), -1)
            loss = sum(kl(teacher, logits_of(heads[e](streams[e][rows])))
                       for e in heads.layers) / len(heads.layers)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(kl=f"{loss.item():.3f}")
    bar.close()
    heads.requires_grad_(False)
    after = evaluate(heads, streams, final, logits_of, held)
    return {"before": before, "after": after, "steps": steps, "seconds": time.perf_counter() - t0}


def kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student)."""
    return F.kl_div(F.log_softmax(student_logits, -1), teacher_logp, log_target=True,
                    reduction="batchmean")


@torch.no_grad()
def evaluate(heads: ExitHeads, streams, final, logits_of, rows: torch.Tensor,
             batch: int = 256) -> dict:
    """{E: {"kl": mean KL, "agree": top-1 agreement with the full model}} over ``rows``."""
    out = {}
    for e in heads.layers:
        total_kl, agree, count = 0.0, 0, 0
        idx = rows
        for i in range(0, len(idx), batch):
            r = idx[i:i + batch]
            t = F.log_softmax(logits_of(final[r]), -1)
            s = logits_of(heads[e](streams[e][r]))
            total_kl += float(kl(t, s)) * len(r)
            agree += int((t.argmax(-1) == s.argmax(-1)).sum())
            count += len(r)
        out[e] = {"kl": total_kl / max(count, 1), "agree": agree / max(count, 1)}
    return out
