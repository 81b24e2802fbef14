"""An independent oracle for the tokenizer tests: byte-level BPE straight from a GGUF file's
metadata (vocabulary, merges, token types), written from llama.cpp's definition of the GPT-2
model and the ``smollm`` pre-tokenizer, with no transformers or tokenizers code involved.

    text -> split out control / user-defined tokens (longest first)
         -> pre-tokenize:  \\p{N} (each digit alone), then the GPT-2 pattern
         -> bytes as GPT-2's printable characters -> merge the lowest-ranked pair until none
"""
from __future__ import annotations

import functools

import regex

# llama.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM (the same expressions as STARCODER)
SMOLLM_PRE_TOKENIZER = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)
CONTROL, USER_DEFINED = 3, 4          # GGUF tokenizer.ggml.token_type values


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes onto printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


class ReferenceBPE:
    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int],
                 pre_tokenizer: tuple[str, ...] = SMOLLM_PRE_TOKENIZER) -> None:
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        special = sorted((t for t, k in zip(tokens, token_types) if k in (CONTROL, USER_DEFINED)),
                         key=len, reverse=True)
        self.special_split = regex.compile("(" + "|".join(map(regex.escape, special)) + ")")
        self.patterns = [regex.compile(p) for p in pre_tokenizer]

    @classmethod
    def from_gguf(cls, path: str) -> "ReferenceBPE":
        import gguf
        fields = gguf.GGUFReader(path).fields
        if fields["tokenizer.ggml.model"].contents() != "gpt2":
            raise ValueError(f"{path!r} is not a byte-level BPE (gpt2) vocabulary")
        if fields["tokenizer.ggml.pre"].contents() != "smollm":
            raise ValueError(f"{path!r}: only the smollm pre-tokenizer is written here")
        return cls(fields["tokenizer.ggml.tokens"].contents(),
                   fields["tokenizer.ggml.merges"].contents(),
                   fields["tokenizer.ggml.token_type"].contents())

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self.special_split.split(text)):
            if i % 2:                         # odd pieces are the special tokens themselves
                ids.append(self.ids[piece])
            else:
                for word in self._pre_tokenize(piece):
                    ids.extend(self.ids[t] for t in self._merge(word))
        return ids

    def _pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self.patterns:
            # llama.cpp keeps both the matches and the text between them
            split = []
            for piece in pieces:
                pos = 0
                for m in pattern.finditer(piece):
                    if m.start() > pos:
                        split.append(piece[pos:m.start()])
                    split.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    split.append(piece[pos:])
            pieces = split
        return [p for p in pieces if p]

    def _merge(self, word: str) -> list[str]:
        table = _bytes_to_unicode()
        parts = [table[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(self.ranks.get(pair, float("inf")), i)
                     for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts
