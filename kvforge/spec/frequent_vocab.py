"""A draft model's LM head over its most frequent tokens only (FR-Spec, Zhao et al. 2025).

The head of a small draft is a large share of what a draft token costs on a memory-bound CPU:
Qwen2.5-Coder-0.5B's 151,936 x 896 Q8_0 head is 145 MB of the ~390 MB a draft step reads.
Drafting over the N most frequent tokens of shipped text reads N / vocab of it. Lossless: the
target verifies every draft, and the draft's distribution q is still a distribution (zero
outside the set), which rejection sampling accepts as any other q; only drafts of rare tokens
are lost (the target supplies those itself).

    full ids   0 ............................................. V-1
    kept       token_ids = [t_0, t_1, ..., t_{N-1}]   (most frequent, plus the special tokens)
    head rows  W[token_ids]  -> logits over N, scattered back into [rows, V] with -inf elsewhere
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import torch

from kvforge.layers.linear import UnquantizedLinearMethod
from kvforge.quant.gguf import GGUFBlocks, GGUFLinearMethod, blocks_multiply, blocks_weight

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 65536
# a draft whose vocabulary is smaller than this many times the set keeps its whole head
AUTO_MIN_RATIO = 2
CORPUS_CHARS = 1_000_000


def resolve_size(requested: int | None, vocab_size: int) -> int:
    """The set size to use: ``requested`` (0 = the whole head), or by default DEFAULT_SIZE
    where the vocabulary is at least AUTO_MIN_RATIO times that (Qwen2.5's 151,936), else the
    whole head. On the Qwen2.5-Coder pair (code chat, batch 1) 65,536 tokens kept the whole
    head's 83% acceptance at 25 instead of 32 ms a draft token (1.25x / 1.23x of the target
    alone for draft / draft + n-gram, against 1.09x / 1.14x); 32,768 lost acceptance (76%)."""
    if requested is None:
        return DEFAULT_SIZE if vocab_size >= AUTO_MIN_RATIO * DEFAULT_SIZE else 0
    check_requested_size(requested)
    return 0 if requested >= vocab_size else requested


def check_requested_size(requested) -> None:
    """ValueError unless ``requested`` is None or an integer >= 0."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int)
                                  or requested < 0):
        raise ValueError(f"speculative_draft_vocab must be an integer >= 0 (0: the whole "
                         f"head), got {requested!r}")


def frequent_token_ids(tokenizer, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` ids most frequent in shipped text (``_corpus``) under ``tokenizer``, plus
    its special tokens, sorted; cached per vocabulary and size."""
    special = {i for i in tokenizer.all_special_ids if 0 <= i < vocab_size}
    key = hashlib.sha256(json.dumps(tokenizer.convert_ids_to_tokens(range(
        tokenizer.vocab_size))).encode()).hexdigest()[:16]
    root = Path(os.environ.get("KVFORGE_CACHE_DIR", Path.home() / ".cache" / "kvforge"))
    path = root / "spec" / f"frequent-v3-{key}-{size}.json"
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        counts = Counter(tokenizer.encode(_corpus(), add_special_tokens=False))
        ranked = [t for t, _ in counts.most_common() if 0 <= t < vocab_size and t not in special]
        # a few MB of text name only ~25k distinct ids; BPE numbers its merges in the order it
        # learnt them, most frequent first, so the lowest ids not seen fill the rest
        seen = set(ranked)
        ranked += [t for t in range(vocab_size) if t not in seen and t not in special]
        ids = sorted(set(ranked[:max(0, size - len(special))]) | special)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids))
        os.replace(tmp, path)
    return torch.tensor(ids, dtype=torch.int64)


def _corpus() -> str:
    """Chat answers (ShareGPT, else The Tempest) and as much code: the Python standard
    library's own source, which every install ships (code drafts need code tokens: with chat
    text alone the 0.5B coder's acceptance fell from 83% to 61%)."""
    from kvforge.eval.corpus import shakespeare_text, sharegpt_text
    try:
        chat = sharegpt_text(max_chars=CORPUS_CHARS)
    except (OSError, ImportError, ValueError):
        chat = shakespeare_text()
    return chat + "\n\n" + _stdlib_source(CORPUS_CHARS)


def _stdlib_source(max_chars: int) -> str:
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "\n\n".join(parts)


class FrequentVocabHead:
    """``compute_logits`` of a draft model over ``token_ids`` only (full-width logits, -inf
    elsewhere, so argmax, sampling and confidences downstream are unchanged). A soft-capped
    head (Gemma 3 configs that set one) is capped here too."""

    def __init__(self, model, token_ids: torch.Tensor) -> None:
        head = model.lm_head
        self.vocab_size = model.config.vocab_size
        self.token_ids = token_ids.to(next(model.parameters()).device)
        method = head.method
        if isinstance(method, GGUFLinearMethod) and len(head.gguf_blocks) == 1:
            b = head.gguf_blocks[0]
            rows = GGUFBlocks(b.raw[token_ids].contiguous(), b.type_name, b.in_features,
                              f"{b.name}[frequent {len(token_ids)}]")
            self.weight = blocks_weight([rows], b.in_features)
        elif isinstance(method, UnquantizedLinearMethod):
            self.weight = head.weight[self.token_ids].contiguous()
        else:
            raise ValueError(f"a frequent-token draft head needs float or GGUF head weights, "
                             f"got {type(method).__name__}")
        self.bias = None if head.bias is None else head.bias[self.token_ids].contiguous()
        self.cap_logits = getattr(model, "cap_logits", None)     # Gemma 3's soft-cap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])
        if isinstance(self.weight, torch.Tensor):
            sub = torch.nn.functional.linear(x, self.weight, self.bias)
        else:
            sub = blocks_multiply(self.weight, x, self.bias)
        sub = sub.float()
        if self.cap_logits is not None:
            sub = self.cap_logits(sub)
        logits = torch.full((x.shape[0], self.vocab_size), float("-inf"), device=x.device)
        logits[:, self.token_ids] = sub
        return logits


def install(model, tokenizer, requested: int | None, head_owner=None) -> int:
    """Give draft ``model`` a frequent-token head where it pays, made from the LM head of
    ``head_owner`` (default the draft itself; a self-draft or exit draft: the target, whose
    head it borrows); returns the set size (0: the whole head kept)."""
    owner = model if head_owner is None else head_owner
    size = resolve_size(requested, owner.config.vocab_size)
    if size == 0:
        return 0
    ids = frequent_token_ids(tokenizer, size, owner.config.vocab_size)
    model.compute_logits = FrequentVocabHead(owner, ids)
    logger.info("draft head: the %d most frequent of %d tokens (FR-Spec)", len(ids),
                owner.config.vocab_size)
    return len(ids)
