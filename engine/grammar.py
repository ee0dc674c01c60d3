"""Constraints as grammars (llguidance), shared by the front end (fast 400s) and the engine core (masks).
No torch here.

llguidance, not xgrammar (docs/structured_outputs.md has the figures): a grammar is ready in ~1-2 ms on our
49k-token vocabulary (xgrammar: 1-10 ms), every step of its work is bounded by fuel limits we configure (a
schema too large or too slow is refused, never left compiling), it reports bad grammars as messages rather
than crashes, and it is one dependency-free wheel (xgrammar pulls triton and apache-tvm-ffi). xgrammar fills
one mask faster (2-16 us against 15-95 us); the engine fills a step's masks in parallel while the forward
runs, which keeps the difference off the step's critical path.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import RequestError, StructuredOutput

# JSON without free whitespace: a weak model under a flexible-whitespace grammar can pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar (llguidance LLParserLimits): max_grammar_size symbols in its productions;
    lexer_fuel for building its lexer (~50k units a millisecond: 1M is ~20 ms); step_fuel per mask. A regex
    whose bounded repeats count past xgrammar_repeats along one nesting chain, or past xgrammar_nested_repeats
    along a chain of two or more that vary, goes to llguidance: xgrammar unrolls them, slowly, and its compile
    cannot be stopped (engine/grammar_xgr.py regex_supported has the measurements)."""
    max_grammar_size: int = 500_000
    lexer_fuel: int = 1_000_000
    step_fuel: int = 200_000
    xgrammar_repeats: int = 2_000
    xgrammar_nested_repeats: int = 64

    def to_llguidance(self):
        import llguidance

        return llguidance.LLParserLimits(max_grammar_size=self.max_grammar_size,
                                         initial_lexer_fuel=self.lexer_fuel, step_lexer_fuel=self.step_fuel)


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of a constraint, or RequestError (code invalid_grammar) when it cannot be one."""
    from llguidance import LLMatcher

    param = so.param()
    try:
        if so.json is not None or so.json_object:
            schema = json.loads(so.json) if so.json is not None else ANY_JSON_OBJECT
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if so.regex is not None:
            return LLMatcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in so.choice))
        return LLMatcher.grammar_from_lark(_lark(so.grammar))
    except Exception as exc:  # a schema that is not JSON, GBNF that does not parse
        raise RequestError(f"{param}: {exc}", "invalid_grammar", param) from None


def _lark(grammar: str) -> str:
    """GBNF (`root ::= ...`, llama.cpp's and vLLM's EBNF) is converted; anything else is read as Lark."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(grammar)


def check_grammar(so: StructuredOutput, tokenizer, limits: GrammarLimits) -> str:
    """The grammar text when it is valid for `tokenizer` (an LLTokenizer) within `limits`; else RequestError."""
    from llguidance import LLMatcher

    text = grammar_text(so)
    error = LLMatcher.validate_grammar(text, tokenizer, limits=limits.to_llguidance())
    if error:
        raise RequestError(f"{so.param()}: {error.strip()[:500]}", "invalid_grammar", so.param())
    return text


def llg_tokenizer(hf_tokenizer, vocab_size: int, eos_ids) -> object:
    """The llguidance view of a HF tokenizer (~0.4 s for 49k tokens: build once). Masks are vocab_size wide
    (the model's logits), and every EOS id ends a grammar. llguidance before 1.7 takes one EOS id (1.6.1 is the
    newest wheel for glibc 2.28, as on our H200 host): then the first of grammar_eos_ids ends it, and
    EosAliases stands the others in for it."""
    import llguidance.hf

    eos = sorted(eos_ids)
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
    except TypeError:  # an int only: the tokenizer's own EOS if it is one of ours
        own = hf_tokenizer.eos_token_id
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                            eos_token=own if own in eos or not eos else eos[0])


def grammar_eos_ids(llg_tok) -> list[int]:
    """The EOS ids an llguidance tokenizer ends grammars with (one before llguidance 1.7)."""
    return list(getattr(llg_tok, "eos_tokens", None) or [llg_tok.eos_token])


@dataclass(frozen=True)
class EosAliases:
    """EOS ids the grammar does not know (llguidance before 1.7 knows one): each is allowed where `primary` is,
    and a matcher consumes `primary` in its place."""
    primary: int
    others: tuple[int, ...]

    @classmethod
    def of(cls, llg_tok, eos_ids) -> EosAliases | None:
        known = grammar_eos_ids(llg_tok)
        others = tuple(sorted(set(eos_ids) - set(known)))
        return cls(known[0], others) if others else None

    def token(self, token: int) -> int:
        return self.primary if token in self.others else token


class LRU:
    """A bounded mapping, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def drop(self, key) -> None:
        self._items.pop(key, None)

    def put(self, key, value) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
