"""Decides, after each appended token, whether a request is finished and what text it keeps.

Checked in this order (the first hit wins):

    num_output_tokens < min_tokens ──► no stop condition counts (length limits still do)
    EOS (unless ignore_eos)         ──► FINISHED_STOPPED, the token's text is dropped
    token in stop_token_ids         ──► FINISHED_STOPPED, stop_reason = token id, text dropped
    stop string in the new text     ──► FINISHED_STOPPED, stop_reason = the string, text cut
    num_output_tokens >= max_tokens ──► FINISHED_LENGTH
    num_tokens >= max_model_len     ──► FINISHED_LENGTH  (the context is full)

("dropped" / "cut" unless ``include_stop_str_in_output``.)

Stop strings are searched only where a new match can be: a match must end inside the text
added by this token, so the search starts ``len(stop) - 1`` chars before it:

    output_text:  ...........|xxxxxxxx|nnnn       n = new_text, x = len(stop) - 1 chars of tail
                             ^ search start

Streaming: text within ``max_stop_len - 1`` chars of the end could still become the start of a
stop string, so ``safe_text_len`` holds it back until more text (or the finish) arrives. The
held-back boundary never moves backwards: a stop string found later starts at or after it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.engine.request import Request, RequestStatus
from kvforge.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopResult:
    """``status`` None = keep going. ``text``: the output text to keep when it must change
    (stop string or stop token text removed), else None. ``stop_reason``: the stop token id or
    stop string that matched (None for EOS and length)."""

    status: RequestStatus | None = None
    text: str | None = None
    stop_reason: int | str | None = None


_CONTINUE = StopResult()


class StopChecker:
    """One per request (a request's stop strings and limits never change)."""

    def __init__(self, sampling_params: SamplingParams, eos_token_ids: tuple[int, ...] | list[int],
                 max_model_len: int) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len!r}")
        self.params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.stop_strings: list[str] = list(sampling_params.stop or ())
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self.max_model_len = max_model_len
        # for ``check``: how much of the output text earlier calls have already searched
        self._checked_text_len = 0

    def update(self, token_id: int, new_text: str, output_text: str, num_output_tokens: int,
               num_tokens: int) -> StopResult:
        """Check after ``token_id`` was appended.

        ``output_text``: the whole output text so far, ending with ``new_text`` (the text this
        token added); ``num_output_tokens`` / ``num_tokens`` count the token already.
        """
        if not output_text.endswith(new_text):
            raise ValueError(f"output_text must end with new_text {new_text!r}")
        self._checked_text_len = len(output_text)
        p = self.params
        if num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return StopResult(RequestStatus.FINISHED_STOPPED, self._drop_token_text(
                    new_text, output_text), None)
            if token_id in self.stop_token_ids:
                return StopResult(RequestStatus.FINISHED_STOPPED, self._drop_token_text(
                    new_text, output_text), token_id)
            hit = self._find_stop_string(new_text, output_text)
            if hit is not None:
                return hit
        if p.max_tokens is not None and num_output_tokens >= p.max_tokens:
            return StopResult(RequestStatus.FINISHED_LENGTH)
        if num_tokens >= self.max_model_len:
            return StopResult(RequestStatus.FINISHED_LENGTH)
        return _CONTINUE

    def check(self, request: Request, token_id: int, output_text: str,
              num_appended_after: int = 0) -> StopResult:
        """``update`` for the engine loop: call once per token, after the token was appended to
        ``request`` and its text to ``output_text``. The new text is whatever ``output_text``
        gained since the previous call. ``num_appended_after``: tokens already appended after
        this one (speculative decoding appends several per step), not counted here.
        """
        new_text = output_text[min(self._checked_text_len, len(output_text)):]
        return self.update(token_id, new_text, output_text,
                           request.num_output_tokens - num_appended_after,
                           request.num_tokens - num_appended_after)

    def safe_text_len(self, output_text: str) -> int:
        """How many leading chars of an unfinished request's text can be streamed now."""
        if not self.stop_strings:
            return len(output_text)
        return max(0, len(output_text) - (self.max_stop_len - 1))

    def _drop_token_text(self, new_text: str, output_text: str) -> str | None:
        # the EOS / stop token's own text (e.g. "</s>" when special tokens are kept) is not output
        if not new_text or self.params.include_stop_str_in_output:
            return None
        return output_text[: len(output_text) - len(new_text)]

    def _find_stop_string(self, new_text: str, output_text: str) -> StopResult | None:
        if not self.stop_strings or not new_text:
            return None
        new_start = len(output_text) - len(new_text)
        best: tuple[int, int, str] | None = None     # (start, end, stop string)
        for stop in self.stop_strings:
            idx = output_text.find(stop, max(0, new_start - len(stop) + 1))
            if idx == -1:
                continue
            # the earliest match wins, whatever the order of the stop list
            if best is None or (idx, idx + len(stop)) < best[:2]:
                best = (idx, idx + len(stop), stop)
        if best is None:
            return None
        start, end, stop = best
        keep = end if self.params.include_stop_str_in_output else start
        return StopResult(RequestStatus.FINISHED_STOPPED, output_text[:keep], stop)
