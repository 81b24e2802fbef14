"""Per-request sampling parameters, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.structured.params import StructuredOutputParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Defaults follow the OpenAI / vLLM conventions: temperature 1.0 samples from the model's
    distribution; ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a value in [-100, 100] added to its logit before
    # sampling (and before greedy's argmax); -100 bans a token, +100 all but forces it
    logit_bias: dict[int, float] | None = None
    # OpenAI's Predicted Outputs: text (or token ids) the output is expected to repeat, e.g. the
    # file an edit rewrites. A hint only: the output is unchanged; an engine that speculates
    # with n-gram lookup also looks it up there (spec/ngram.py), so matching spans verify in
    # one step
    prediction: str | list[int] | None = None
    # the output must match this JSON schema / regex / choice / grammar (kvforge/structured);
    # a dict of StructuredOutputParams' fields is accepted
    structured_output: StructuredOutputParams | None = None
    # masked-diffusion models only (kvforge/diffusion, docs/diffusion.md): steps over the
    # max_tokens canvas (None: one token per step), block length, which masks are committed
    # first, Fast-dLLM's confidence threshold (None: the fixed schedule) and K/V cache mode
    diffusion_steps: int | None = None
    diffusion_block_length: int = 32
    remasking: str = "low_confidence"
    parallel_threshold: float | None = None
    diffusion_cache: str = "none"

    def __post_init__(self) -> None:
        self.structured_output = StructuredOutputParams.from_value(self.structured_output)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.prediction is not None and not isinstance(self.prediction, str):
            if isinstance(self.prediction, (bytes, dict)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in self.prediction):
                raise ValueError(f"prediction must be text or a list of token ids, got "
                                 f"{type(self.prediction).__name__}")
            self.prediction = list(self.prediction)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.structured_output is not None and self.min_tokens > 0:
            # the grammar decides where the output ends: once it allows only EOS, min_tokens
            # would leave nothing to sample
            raise ValueError(f"min_tokens ({self.min_tokens}) cannot be combined with "
                             f"structured_output: the grammar decides where the output ends")
        if self.top_k == 0:
            self.top_k = -1
        self._validate_diffusion()

    def _validate_diffusion(self) -> None:
        from kvforge.diffusion import CACHE_MODES, REMASKING
        if self.diffusion_steps is not None and (not isinstance(self.diffusion_steps, int)
                                                 or self.diffusion_steps < 1):
            raise ValueError(f"diffusion_steps must be None or an integer >= 1, got "
                             f"{self.diffusion_steps!r}")
        if not isinstance(self.diffusion_block_length, int) or self.diffusion_block_length < 1:
            raise ValueError(f"diffusion_block_length must be an integer >= 1, got "
                             f"{self.diffusion_block_length!r}")
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {', '.join(REMASKING)}, got "
                             f"{self.remasking!r}")
        if self.diffusion_cache not in CACHE_MODES:
            raise ValueError(f"diffusion_cache must be one of {', '.join(CACHE_MODES)}, got "
                             f"{self.diffusion_cache!r}")
        if self.parallel_threshold is not None:
            if not 0.0 < self.parallel_threshold <= 1.0:
                raise ValueError(f"parallel_threshold must be in (0, 1], got "
                                 f"{self.parallel_threshold!r}")
            if self.remasking != "low_confidence":
                raise ValueError(f"parallel_threshold compares token probabilities: it needs "
                                 f"remasking='low_confidence', got {self.remasking!r}")
            if self.diffusion_steps is not None:
                raise ValueError(f"parallel_threshold sets the steps itself: leave "
                                 f"diffusion_steps None, got {self.diffusion_steps!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """``bias`` as {token id: float}, None when empty; ValueError naming a bad entry (the
    vocabulary range is the engine's check: it knows the model)."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to values, got {type(bias).__name__}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not -100.0 <= value <= 100.0):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} "
                             f"for token {token}")
        out[token] = float(value)
    return out
