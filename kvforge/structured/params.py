"""StructuredOutputParams: what a request's output must match, validated on creation.

Exactly one kind per request, each turned into one llguidance grammar (``to_grammar``):

    json          a JSON schema (dict or its JSON text)      OpenAI response_format json_schema
    json_object   any JSON object                            OpenAI response_format json_object
    regex         a regular expression (Rust regex syntax)   vLLM guided_regex
    choice        one of a list of strings                   vLLM guided_choice
    grammar       a Lark grammar (or GBNF)                   vLLM guided_grammar

JSON is written compactly, with Python's ``json.dumps`` separators (``", "`` and ``": "``) and no
other whitespace: free whitespace would let a sampling model pad its output without end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# the separators of json.dumps: the layout models see most in their training data
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputParams:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("structured output needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"json schema is not valid JSON: {e}") from e
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"json schema must be an object, got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def cache_key(self) -> str:
        """Equal for requests that compile to the same grammar."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar, "json_object": self.json_object}[self.kind]
        return self.kind + ":" + json.dumps(value, sort_keys=True)

    def to_grammar(self) -> str:
        """The llguidance grammar text (not yet checked: GrammarCompiler validates it)."""
        from llguidance import LLMatcher
        kind = self.kind
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(self.json, overrides=JSON_LAYOUT)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            # Lark string literals take JSON escapes, so json.dumps quotes any text safely
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
        # Lark as is; GBNF (llama.cpp's EBNF dialect, ``root ::= ...``) converted by llguidance
        from llguidance.gbnf_to_lark import any_to_lark
        return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputParams | None":
        """A StructuredOutputParams as is, or one from a dict of its fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"json", "json_object", "regex", "choice", "grammar"}
            if unknown:
                raise ValueError(f"unknown structured output field(s) {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"structured_output must be a StructuredOutputParams or a dict, got "
                         f"{type(value).__name__}")
