"""GrammarCompiler: one engine's llguidance tokenizer and its validated grammars.

Why llguidance (docs/structured_outputs.md has the measurements): its masks cost ~0.1 ms a token
on our 49k and 152k vocabularies, with no compile step to speak of (a JSON schema is ready in
~2 ms, so a new schema never stalls the batch), and it needs no other package.

The tokenizer view (every token's bytes) takes ~0.4 s for 49k tokens, 1.5 s for 152k: it is
built on the first constrained request, not at engine start. Validated grammars are cached by
the request's structured-output key, so a repeated schema skips conversion and checking.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from kvforge.structured.matcher import GrammarMatcher
from kvforge.structured.params import StructuredOutputParams

_CACHE_SIZE = 256


class GrammarCompiler:
    """``compile(params) -> grammar text`` (ValueError with llguidance's message if bad) and
    ``matcher(params) -> GrammarMatcher``. Thread-safe: the server validates on its own thread
    while the engine thread makes matchers."""

    def __init__(self, load_hf_tokenizer, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        """``load_hf_tokenizer``: a function returning the transformers tokenizer, called on
        the first structured request (loading transformers costs seconds of every start
        otherwise; ``kvforge.Tokenizer`` reads a cached GGUF tokenizer without it)."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size!r}")
        self._load_hf_tokenizer = load_hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, str] = OrderedDict()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                # the model's vocabulary (it may be padded past the tokenizer's): ids the
                # tokenizer does not know are never allowed
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._load_hf_tokenizer(), n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids) or None)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputParams) -> str:
        key = params.cache_key()
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        from llguidance import LLMatcher
        try:
            grammar = params.to_grammar()
        except Exception as e:      # llguidance's converters raise ValueError and friends
            raise ValueError(f"invalid {params.kind} for structured output: {e}") from e
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(f"invalid {params.kind} for structured output: "
                             f"{messages[0] if messages else 'rejected by the grammar engine'}")
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, params: StructuredOutputParams) -> GrammarMatcher:
        from llguidance import LLMatcher
        inner = LLMatcher(self.ll_tokenizer, self.compile(params), log_level=0)
        if inner.is_error():        # validated above, so only resource limits land here
            raise ValueError(f"invalid {params.kind} for structured output: {inner.get_error()}")
        return GrammarMatcher(inner, self.eos_token_ids)
