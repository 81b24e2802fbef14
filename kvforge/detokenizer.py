"""Incremental detokenization: turn a growing list of output ids into text deltas.

Byte-level BPE tokens are byte strings, and one character (an emoji, a CJK ideograph) can be
split over several tokens. Decoding a prefix that stops inside a character yields U+FFFD, so
a delta may only be emitted once its bytes are complete.

Two offsets into the output ids keep each step O(window) instead of O(output):

    output ids:  t0 t1 t2 t3 t4 t5 t6 t7 t8
                          ^prefix   ^read   ^end
                 |emitted | context |pending|

    prefix_text = decode(ids[prefix:read])   text already emitted, re-decoded as context
    new_text    = decode(ids[prefix:end])
    delta       = new_text[len(prefix_text):]   emitted iff it does not end in U+FFFD
    then prefix <- read, read <- end

The context window makes the delta correct where a token's text depends on its neighbour
(e.g. sentencepiece's leading-space rule). Only output ids are decoded, never the prompt, so
the concatenated deltas equal ``tokenizer.decode(output_ids)`` exactly.
"""
from __future__ import annotations

from typing import Sequence

from kvforge.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Kept for callers that want it; the output text is defined over output ids only.
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._pieces: list[str] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far (excludes a trailing incomplete character)."""
        return "".join(self._pieces)

    def step(self, new_token_ids: Sequence[int], *, final: bool = False) -> str:
        """Append ids; return the newly completed text ('' while a character is incomplete).

        ``final=True`` flushes what is pending even if it ends in U+FFFD (a sequence that the
        model really ended with invalid or cut-off bytes), so the total equals a full decode.
        """
        self.output_token_ids.extend(int(t) for t in new_token_ids)
        ids = self.output_token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:])
        if not new_text.startswith(prefix_text):
            # The context re-decoded differently once more ids follow (should not happen for
            # stateless decoders); fall back to a full decode so the text stays exact.
            return self._resync(final)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR)
                                                 and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is still pending; call once when the request finishes."""
        return self.step((), final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _resync(self, final: bool) -> str:
        full = self._decode(self.output_token_ids)
        emitted = self.output_text
        if full.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        if not full.startswith(emitted):
            raise RuntimeError("incremental detokenization diverged from a full decode")
        delta = full[len(emitted):]
        self.prefix_offset = self.read_offset = len(self.output_token_ids)
        if delta:
            self._pieces.append(delta)
        return delta
