"""xgrammar for the masks of JSON schemas and regexes; llguidance (engine/grammar.py) for everything else.

Why two: a step's masks at batch 256 under bench/structured_mix.py's record schema, on the byte-level BPE of
the H200 pair's model (151,936 ids), filled for every row by each engine's batch fill (2026-12-05):
llguidance 28.8 ms on the H200 host's 16 cores, 21.7 ms on the 2-core CPU; xgrammar 1.7 and 3.8 ms
(`benchmarks/grammar_engines.py --batch 256 --tokenizer wb-bpe`). Through the server the llguidance fill
set the pace: W-B with every request constrained ran at 0.28x the free load (TPOT 21.5 against 4.4 ms).
xgrammar precomputes each grammar state's tokens when it compiles; llguidance walks the token trie per mask,
and the bounded strings (`maxLength`) of the schema make most lexer states new.

llguidance keeps what xgrammar does not take: Lark and GBNF grammars, choices, schemas with a keyword outside
JSON_KEYWORDS (xgrammar may drop one it does not know; this list is what tests/test_grammar_xgr.py checks),
and any constraint whose xgrammar compile fails or outlasts COMPILE_TIMEOUT_S (xgrammar's compile has no
fuel limit; the front end's llguidance check already bounded the grammar's size). The front end checks every
constraint with llguidance either way, so what is refused, and how, does not depend on the backend.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from engine.grammar import GrammarLimits
from engine.request import StructuredOutput

try:  # Python 3.11+
    from re import _constants as _C
    from re import _parser as _re_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _C
    import sre_parse as _re_parser

_REPEATS = (_C.MAX_REPEAT, _C.MIN_REPEAT, getattr(_C, "POSSESSIVE_REPEAT", _C.MAX_REPEAT))
_MAXREPEAT = _C.MAXREPEAT
DEFAULT_LIMITS = GrammarLimits()

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0  # past it the constraint compiles with llguidance (the record schema: ~40 ms)
# Compiles run side by side (the engine's compile threads, and xgrammar's here), so one slow to compile does not
# hold the constraints after it for its COMPILE_TIMEOUT_S: tests/test_grammar_xgr.py compiles one behind a stuck one.
COMPILE_THREADS = 2
# Schema keywords xgrammar enforces (or, for annotations, need not): tests/test_grammar_xgr.py walks outputs
# under its masks for each and validates them with jsonschema.
JSON_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "anyOf", "oneOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems",
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
})
BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'  # xgrammar's characters of a string with maxLength/minLength
JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'  # those of its unbounded strings: no control characters
SURROGATES = r"\uD800-\uDFFF"  # UTF-16 halves: xgrammar 0.2.9 takes their 3-byte forms (invalid UTF-8) as characters
ANY_CHAR = r"[\0-\U0010ffff]"  # a regex's `.` in xgrammar's EBNF
# xgrammar's lookahead after a JSON string (whitespace, then `,` `}` `]` or `:`), and compact JSON's (no whitespace)
STRING_LOOKAHEAD = (r"(=([ \n\r\t]* [,}\]:]))", r"(=([,}\]:]))")
_EBNF_PIECE = re.compile(r'"(?:\\.|[^"\\])*"|\[\^((?:\\.|[^\]\\])*)\]')  # a string literal, or a negated class
NAMED_CHILDREN = frozenset({"properties", "$defs", "definitions"})  # their keys are names, not keywords


@functools.cache
def available() -> bool:
    """Whether xgrammar imports. Found is not enough: on the GPU host without pydantic it was found, failed to
    import in the compile thread, and every JSON-schema request failed (structured_step.py, 2026-12-05)."""
    try:
        import xgrammar  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means llguidance does the work
        if importlib.util.find_spec("xgrammar") is not None:
            logger.warning("xgrammar is installed but does not import (%s): llguidance fills every mask", exc)
        return False
    return True


def json_supported(schema, limits: GrammarLimits = DEFAULT_LIMITS) -> bool:
    """Whether every keyword of the schema, at every depth, is one xgrammar enforces, and each of its patterns
    one it compiles soon (regex_supported)."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or not JSON_KEYWORDS.issuperset(schema):
        return False
    return all(_children_supported(key, value, limits) for key, value in schema.items())


def _children_supported(key: str, value, limits: GrammarLimits) -> bool:
    if key in NAMED_CHILDREN:
        return isinstance(value, dict) and all(json_supported(v, limits) for v in value.values())
    if key in ("items", "additionalProperties"):
        return json_supported(value, limits)
    if key in ("prefixItems", "anyOf", "oneOf"):
        return isinstance(value, list) and all(json_supported(v, limits) for v in value)
    if key == "pattern":
        return not isinstance(value, str) or regex_supported(value, limits)
    return True  # a value: enum's list, a bound, an annotation


def regex_supported(pattern: str, limits: GrammarLimits = DEFAULT_LIMITS) -> bool:
    """Whether xgrammar compiles the regex soon. It unrolls bounded repeats: on the 2-core CPU (smollm2's
    tokenizer) `.{0,1000}` took 0.35 s, `.{0,2000}` 1.6 s, `.{0,8000}` 29 s, `[a-z]{1,5000}` 1.3 s; nested ones
    multiply: `([a-z]{1,10}){1,10}` 0.85 s, `{1,20}` in `{1,20}` 4.8 s, `{1,30}` in `{1,30}` 12 s,
    `(([a-z]{1,4}){1,5}){1,5}` 2.8 s; a loop is cheap (`([a-z]{1,30})*` 0.10 s). Its compile cannot be stopped.
    So a regex whose counts multiply past limits.xgrammar_repeats along one chain of nested repeats, or past
    limits.xgrammar_nested_repeats along a chain of two or more that vary, goes to llguidance, which matches
    lazily. A pattern Python's parser cannot read is left to xgrammar (its failure, or its timeout, sends it to
    llguidance)."""
    try:
        parsed = _re_parser.parse(pattern)
    except Exception:  # noqa: BLE001 - another dialect (a JSON schema's pattern is ECMA-262's)
        return True
    count, _, nested = _nested_repeats(list(parsed))
    return count <= limits.xgrammar_repeats and nested <= limits.xgrammar_nested_repeats


def _nested_repeats(items: list) -> tuple[int, bool, int]:
    """Over the parsed regex items: the largest product of bounded repeat counts along one chain of nested
    repeats, whether that chain varies, and the largest product over chains of two or more that vary."""
    best, varies, worst = 1, False, 1
    for op, av in items:
        for sub in _subpatterns(op, av):
            count, sub_varies, sub_worst = _nested_repeats(list(sub))
            if op in _REPEATS and av[1] != _MAXREPEAT:
                if count > 1 and (sub_varies or av[0] < av[1]):
                    sub_worst = max(sub_worst, count * av[1])
                count, sub_varies = count * av[1], sub_varies or av[0] < av[1]
            if count > best:
                best, varies = count, sub_varies
            worst = max(worst, sub_worst)
    return best, varies, worst


def _subpatterns(op, av) -> list:
    """The parsed sub-patterns of one regex item (none for a literal, a class, an anchor, ...)."""
    if op in _REPEATS:
        return [av[2]]
    if op is _C.SUBPATTERN:
        return [av[3]]
    if op is _C.BRANCH:
        return list(av[1])
    if op in (_C.ASSERT, _C.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_C, "ATOMIC_GROUP", None):
        return [av]
    if op is _C.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    return []


def json_ebnf(schema) -> str:
    """xgrammar's grammar of a schema: compact JSON and extra properties allowed, as llguidance's (engine/grammar.py
    JSON_OPTIONS), made safe by safe_ebnf. xgrammar 0.2.9 also lets a string with maxLength hold raw control
    characters (invalid JSON: a random model wrote "\\x08" into one); its characters are narrowed here to those of
    its unbounded strings. Such a string then holds no escapes (a valid JSON subset; llguidance allows them).
    And its strings' lookahead lets whitespace follow a closing quote even in compact JSON, where none may: the
    mask then allowed a token such as `","` + newline after a key's opening quote, which the matcher refused (a
    request failed with invalid_grammar: 3 of 2,560 at W-B json 100% on an H100, twenty-third session); the
    lookahead is narrowed to what compact JSON has there (STRING_LOOKAHEAD)."""
    import xgrammar

    text = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=False))
    text = text.replace(STRING_LOOKAHEAD[0], STRING_LOOKAHEAD[1])
    return safe_ebnf(text.replace(BOUNDED_STRING_CHARS, JSON_STRING_CHARS))


def regex_ebnf(pattern: str) -> str:
    import xgrammar

    return safe_ebnf(str(xgrammar.Grammar.from_regex(pattern)))


def safe_ebnf(text: str) -> str:
    """Every negated character class of an EBNF grammar also excludes the UTF-16 surrogates: xgrammar 0.2.9 matched
    the bytes ED A3 BD (U+D8FD, not UTF-8) as one character of a string with maxLength 2 (tests/test_soak.py).
    So does a regex's `.` (ANY_CHAR); a positive class spanning them otherwise is left as it is. String literals
    are left as they are."""
    def patch(m: re.Match) -> str:
        return m.group(0) if m.group(1) is None else f"[^{m.group(1)}{SURROGATES}]"

    return _EBNF_PIECE.sub(patch, text).replace(ANY_CHAR, f"[^{SURROGATES}]")


class XgrGrammar:
    """One completion's position in an xgrammar grammar (engine.structured.Grammar's interface)."""
    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def error(self) -> str | None:
        return "the token is outside the grammar"


class XgrCompiled:
    """A compiled xgrammar grammar: requests get matchers of their own."""
    __slots__ = ("compiled",)

    def __init__(self, compiled) -> None:
        self.compiled = compiled

    def new_grammar(self) -> XgrGrammar:
        import xgrammar

        return XgrGrammar(xgrammar.GrammarMatcher(self.compiled))


class XgrCompiler:
    """Compiles the constraints xgrammar takes, in threads of its own (COMPILE_THREADS), within COMPILE_TIMEOUT_S."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids, fill_threads: int | None = None,
                 limits: GrammarLimits = DEFAULT_LIMITS) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_ids))
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # StructuredOutputs caches
        self.limits = limits
        self._thread = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="kvserve-xgrammar")
        self._overdue: set[Future] = set()  # compiles past COMPILE_TIMEOUT_S, still running (they can't be stopped)
        self._overdue_lock = threading.Lock()  # the engine's compile threads call compile() side by side
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=fill_threads or "auto")

    def compile(self, so: StructuredOutput) -> XgrCompiled | None:
        """The constraint compiled by xgrammar, or None: llguidance's to compile. While compiles that outlasted
        COMPILE_TIMEOUT_S hold every xgrammar thread, each constraint goes to llguidance at once: queued behind
        them, each would wait out its own timeout, one after another (a pattern of nested bounded repeats,
        `([a-z]{1,30}){1,30}`, took xgrammar 12 s on the 2-core CPU; one such request held every later schema
        5 s each)."""
        build = self._builder(so)
        if build is None:
            return None
        if self._threads_overdue() >= COMPILE_THREADS:
            logger.info("xgrammar's threads are on compiles past %.0f s; llguidance compiles %s", COMPILE_TIMEOUT_S,
                        so.param())
            return None
        future = self._thread.submit(build)
        try:
            return XgrCompiled(future.result(timeout=COMPILE_TIMEOUT_S))
        except FutureTimeout:
            with self._overdue_lock:
                self._overdue.add(future)
            logger.warning("xgrammar took over %.0f s to compile %s; llguidance compiles it", COMPILE_TIMEOUT_S,
                           so.param())
        except Exception as exc:  # noqa: BLE001 - a construct xgrammar refuses: llguidance may take it
            logger.info("xgrammar cannot compile %s (%s); llguidance compiles it", so.param(), exc)
        return None

    def _threads_overdue(self) -> int:
        """How many xgrammar threads still run a compile that outlasted its timeout."""
        with self._overdue_lock:
            self._overdue = {f for f in self._overdue if not f.done()}
            return len(self._overdue)

    def _builder(self, so: StructuredOutput):
        c = self._compiler
        if so.json is not None or so.json_object:
            schema = json.loads(so.json) if so.json is not None else {"type": "object"}
            if not json_supported(schema, self.limits):
                return None
            return lambda: c.compile_grammar(json_ebnf(schema))
        if so.regex is not None:
            if not regex_supported(so.regex, self.limits):
                return None
            return lambda: c.compile_grammar(regex_ebnf(so.regex))
        return None

    def fill(self, rows: list, bitmask) -> None:
        """Fill bitmask rows: `rows` holds (matcher, row index) pairs. A matcher that took EOS has ended (its
        request too: the step was scheduled before the engine read that token); its row allows everything."""
        live = []
        for m, j in rows:
            if m.is_terminated():
                bitmask[j] = -1
            else:
                live.append((m, j))
        if live:
            self.batch.batch_fill_next_token_bitmask([m for m, _ in live], bitmask, [j for _, j in live])

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
