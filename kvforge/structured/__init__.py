"""Grammar-constrained decoding (structured outputs): JSON schemas, regexes, choices, grammars.

    StructuredOutputParams   what one request's output must match (sampling_params.py holds it)
    GrammarCompiler          the engine's llguidance tokenizer + validated grammars, cached
    GrammarMatcher           one sequence's parser state: its next-token mask, advanced with
                             each accepted token
    token_bitmask            the batch's [B, V] allowed-token mask, applied before sampling
"""
from kvforge.structured.params import StructuredOutputParams

__all__ = ["StructuredOutputParams"]
