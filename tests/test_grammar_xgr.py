"""xgrammar's masks (engine/grammar_xgr.py): which constraints it takes, that what it allows stays inside the
constraint for every schema keyword it is trusted with, that the rest falls back to llguidance, and that a
step mixing both fills each row as either would alone."""
from __future__ import annotations

import json
import random
import re
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from engine import grammar_xgr
from engine.grammar_xgr import XgrGrammar, json_supported
from engine.request import StructuredOutput
from engine.structured import Grammar, StructuredOutputs

pytest.importorskip("xgrammar")
VOCAB = 49152

# One schema per group of trusted keywords (JSON_KEYWORDS); each bounded so a random walk ends.
SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "enum_const": {"type": "object", "properties": {"s": {"enum": ["open", "closed", 3]}, "k": {"const": "x"}},
                   "required": ["s", "k"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
              "minItems": 1, "maxItems": 3},
    "prefix": {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "null"}], "items": False},
    "union": {"anyOf": [{"type": "string", "minLength": 2, "maxLength": 4}, {"type": "number", "maximum": 5}]},
    "oneof_ref": {"$defs": {"p": {"type": "object", "properties": {"v": {"type": "boolean"}}, "required": ["v"],
                                  "additionalProperties": False}},
                  "oneOf": [{"$ref": "#/$defs/p"}, {"type": "null"}], "title": "t", "description": "d"},
    "pattern": {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,4}@[a-z]{1,3}\\.io$"}},
                "required": ["email"], "additionalProperties": False},
}
REGEXES = ["[a-z]{1,8}z", "(yes|no|maybe)!?", "\\d{3}-\\d{2}"]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def rows(*grammars) -> list:
    return [SimpleNamespace(grammar=g) for g in grammars]


def allowed_tokens(so: StructuredOutputs, grammar, vocab: int = VOCAB) -> list[int]:
    bits = so.fill(rows(grammar)).bitmask[0]
    unpacked = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return unpacked.nonzero().flatten().tolist()


def walk(so: StructuredOutputs, grammar, eos: int, rng: random.Random, limit: int = 300, vocab: int = VOCAB
         ) -> list[int]:
    """Tokens drawn at random from each mask (EOS once allowed) until the grammar ends; every one accepted."""
    out = []
    for _ in range(limit):
        allowed = allowed_tokens(so, grammar, vocab)
        token = eos if eos in allowed else rng.choice(allowed)
        assert grammar.accept(token), f"the matcher refused token {token} its own mask allowed"
        if token == eos:
            return out
        out.append(token)
    raise AssertionError(f"no end within {limit} tokens: {out[:40]}")


@pytest.fixture(scope="module")
def xgr(tok):
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="xgrammar")
    yield so
    so.shutdown()


@pytest.mark.parametrize("name", SCHEMAS)
def test_outputs_under_xgrammar_masks_satisfy_each_trusted_keyword(xgr, tok, name):
    schema = SCHEMAS[name]
    assert json_supported(schema)
    compiled = xgr.compile(StructuredOutput(json=json.dumps(schema)))
    rng = random.Random(name)
    for _ in range(6):
        grammar = xgr.new_grammar(compiled)
        assert isinstance(grammar, XgrGrammar)
        text = tok.decode(walk(xgr, grammar, tok.eos_token_id, rng))
        jsonschema.validate(json.loads(text), schema)


def test_xgrammar_json_is_compact_and_takes_extra_properties_as_llguidance_does(xgr, tok):
    """engine/grammar.py's JSON options: no free whitespace; properties beyond the schema's allowed."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compiled = xgr.compile(StructuredOutput(json=json.dumps(schema)))

    def takes(text: str) -> bool:
        grammar = xgr.new_grammar(compiled)
        return all(grammar.accept(t) for t in tok.encode(text, add_special_tokens=False)) and \
            tok.eos_token_id in allowed_tokens(xgr, grammar)

    assert takes('{"a":1}') and takes('{"a":1,"b":"x"}')
    assert not takes('{"a": 1}') and not takes('{ "a":1}') and not takes('{"a":"1"}')


@pytest.mark.parametrize("pattern", REGEXES)
def test_outputs_under_xgrammar_regex_masks_match_the_regex(xgr, tok, pattern):
    compiled = xgr.compile(StructuredOutput(regex=pattern))
    rng = random.Random(pattern)
    for _ in range(6):
        grammar = xgr.new_grammar(compiled)
        assert isinstance(grammar, XgrGrammar)
        text = tok.decode(walk(xgr, grammar, tok.eos_token_id, rng))
        assert re.fullmatch(pattern, text), text


def test_keywords_xgrammar_is_not_trusted_with_go_to_llguidance(xgr):
    untrusted = [{"type": "string", "format": "date-time"},
                 {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 3}}},
                 {"type": "object", "properties": {"format": {"type": "string"}}, "patternProperties": {}},
                 {"type": "array", "items": {"type": "string", "format": "email"}}]
    assert json_supported({"type": "object", "properties": {"format": {"type": "string"}}})  # a name, not a keyword
    for schema in untrusted:
        assert not json_supported(schema), schema
        grammar = xgr.new_grammar(xgr.compile(StructuredOutput(json=json.dumps(schema))))
        assert isinstance(grammar, Grammar), schema
    for so in (StructuredOutput(choice=["a", "b"]), StructuredOutput(grammar='root ::= "a" | "b"')):
        assert isinstance(xgr.new_grammar(xgr.compile(so)), Grammar)


def test_a_compile_past_the_timeout_goes_to_llguidance(tok, monkeypatch):
    monkeypatch.setattr(grammar_xgr, "COMPILE_TIMEOUT_S", 0.0)
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="auto")
    try:
        grammar = so.new_grammar(so.compile(StructuredOutput(json=json.dumps(SCHEMAS["object"]))))
        assert isinstance(grammar, Grammar)
    finally:
        so.shutdown()


def stuck_builds(monkeypatch, release: threading.Event, built: list):
    """XgrCompiler's builds, the schemas titled "stuck" held until `release`; the others recorded in `built`."""
    real = grammar_xgr.XgrCompiler._builder

    def builder(self, so):
        build = real(self, so)
        if json.loads(so.json).get("title") != "stuck":
            return lambda: built.append(so.json) or build()
        return lambda: release.wait(30) and build()

    monkeypatch.setattr(grammar_xgr.XgrCompiler, "_builder", builder)


def schema(title: str) -> StructuredOutput:
    return StructuredOutput(json=json.dumps({**SCHEMAS["object"], "title": title}))


def test_compiles_past_the_timeout_hold_one_xgrammar_thread_each_and_then_none_waits(tok, monkeypatch):
    """A compile that outlasts the timeout keeps its xgrammar thread (it cannot be stopped); the next ones
    compile on the other thread; once every thread is so held, each constraint goes to llguidance at once, never
    queued behind them; once they end, xgrammar compiles again. Before, every constraint after a stuck one
    waited for it and then its own timeout, one after another."""
    monkeypatch.setattr(grammar_xgr, "COMPILE_TIMEOUT_S", 0.3)
    release, built = threading.Event(), []
    stuck_builds(monkeypatch, release, built)
    compiler = grammar_xgr.XgrCompiler(tok, VOCAB, [tok.eos_token_id])
    try:
        assert compiler.compile(schema("stuck")) is None  # past the timeout: llguidance's
        assert compiler.compile(schema("a")) is not None and len(built) == 1  # the other thread
        assert compiler.compile(schema("stuck")) is None  # every thread held now
        started = time.monotonic()
        assert compiler.compile(schema("b")) is None
        assert time.monotonic() - started < grammar_xgr.COMPILE_TIMEOUT_S
        release.set()
        for future in list(compiler._overdue):
            future.result(timeout=30)
        assert len(built) == 1  # "b" was never queued for xgrammar
        assert compiler.compile(schema("c")) is not None
    finally:
        release.set()
        compiler.shutdown()


def test_a_constraint_behind_one_slow_to_compile_is_ready_first(tok, monkeypatch):
    """The engine's compiles run side by side: a schema asked for after one whose xgrammar compile is stuck is
    compiled, by xgrammar, while the stuck one still waits out its timeout."""
    monkeypatch.setattr(grammar_xgr, "COMPILE_TIMEOUT_S", 5.0)
    release, built = threading.Event(), []
    stuck_builds(monkeypatch, release, built)
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="auto")
    try:
        slow = so.compile(schema("stuck"))
        fast = so.compile(schema("a"))
        assert isinstance(fast.result(timeout=4.0), grammar_xgr.XgrCompiled) and not slow.done()
        release.set()
        assert slow.result(timeout=30) is not None
    finally:
        release.set()
        so.shutdown()


@pytest.mark.parametrize("pattern,xgrammar", [
    ("^([a-z]{1,30}){1,30}$", False), ("^([a-z]{1,8}){1,8}$", True), ("^([a-z]{1,9}){1,9}$", False),
    ("^(([a-z]{1,4}){1,5}){1,5}$", False), ("^([a-z]{1,30}){5}$", False), ("^([a-z]{1,30})*$", True),
    ("^[a-z]{1,900}$", True), ("^.{0,2000}$", True), ("^.{0,8000}$", False), ("^\\d{3}-\\d{4}$", True),
    ("^((ab){3}){4}$", True), ("(?<name>x)", True)])
def test_regexes_xgrammar_would_unroll_too_far_go_to_llguidance(pattern, xgrammar):
    """Bounded repeats multiply along a nesting chain (xgrammar unrolls them: ~12 s for the first pattern on the
    2-core CPU); those past the limits go to llguidance, in a regex or a schema's pattern at any depth. One
    Python cannot parse is left to xgrammar (its failure or timeout decides)."""
    assert grammar_xgr.regex_supported(pattern) is xgrammar
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "pattern": pattern}}}}
    assert json_supported(schema) is xgrammar


def test_a_pattern_xgrammar_would_take_seconds_on_compiles_with_llguidance_at_once(tok):
    """The engine's compile of the 12 s pattern is llguidance's, in well under xgrammar's 5 s timeout."""
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="auto")
    try:
        pattern = StructuredOutput(json=json.dumps({"type": "string", "pattern": "^([a-z]{1,30}){1,30}$"}))
        assert not isinstance(so.compile(pattern).result(timeout=3.0), grammar_xgr.XgrCompiled)
        assert isinstance(so.compile(StructuredOutput(regex="([a-z]{1,30}){1,30}")).result(timeout=3.0),
                          grammar_xgr.XgrCompiled) is False
    finally:
        so.shutdown()


def test_the_repeat_limits_reach_the_compiler_from_the_engine_config(tok):
    """--grammar-xgrammar-repeats / --grammar-xgrammar-nested-repeats: the engine's structured outputs (here
    in its own process) screen patterns with the configured limits."""
    from engine import setup
    from engine.config import EngineConfig

    config = EngineConfig(model="m", grammar_xgrammar_repeats=100, grammar_xgrammar_nested_repeats=5,
                          structured_outputs_process=False)
    so = setup.structured_outputs(config, tok, VOCAB, [tok.eos_token_id], torch.device("cpu"))
    try:
        assert (so.limits.xgrammar_repeats, so.limits.xgrammar_nested_repeats) == (100, 5)
        assert grammar_xgr.regex_supported("^[a-z]{1,100}$", so.limits)
        assert not grammar_xgr.regex_supported("^[a-z]{1,101}$", so.limits)
        assert not grammar_xgr.regex_supported("^([a-z]{1,2}){1,3}$", so.limits)
        assert not isinstance(so.compile(StructuredOutput(regex="[a-z]{1,101}")).result(timeout=30),
                              grammar_xgr.XgrCompiled)
        assert isinstance(so.compile(StructuredOutput(regex="[a-z]{1,100}")).result(timeout=30),
                          grammar_xgr.XgrCompiled)
    finally:
        so.shutdown()


def test_guidance_backend_never_uses_xgrammar(tok):
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="guidance")
    try:
        for c in (StructuredOutput(json=json.dumps(SCHEMAS["object"])), StructuredOutput(regex="[a-z]+")):
            assert isinstance(so.new_grammar(so.compile(c)), Grammar)
    finally:
        so.shutdown()


def test_a_step_mixing_both_engines_fills_each_row_as_alone(xgr, tok):
    """Rows of xgrammar and llguidance grammars in one fill get the masks each gets alone; a row whose
    matcher already took EOS (its request ended after the step was scheduled) allows everything."""
    json_so = StructuredOutput(json=json.dumps(SCHEMAS["object"]))
    lark_so = StructuredOutput(grammar='root ::= "hello" [0-9]')
    a, b, ended = (xgr.new_grammar(xgr.compile(c)) for c in (json_so, lark_so, StructuredOutput(regex="ok")))
    assert isinstance(a, XgrGrammar) and isinstance(b, Grammar)
    for token in tok.encode("ok", add_special_tokens=False) + [tok.eos_token_id]:
        assert ended.accept(token)
    alone = [xgr.fill(rows(g)).bitmask[0].clone() for g in (a, b)]
    together = xgr.fill(rows(a, None, b, ended))
    assert together.rows == [0, 2, 3]
    assert torch.equal(together.bitmask[0], alone[0]) and torch.equal(together.bitmask[1], alone[1])
    assert (together.bitmask[2] == -1).all()
    assert alone[0].count_nonzero() and not torch.equal(alone[0], alone[1])


def test_eos_ends_an_xgrammar_grammar_only_where_it_may(xgr, tok):
    eos = tok.eos_token_id
    grammar = xgr.new_grammar(xgr.compile(StructuredOutput(regex="ab")))
    assert eos not in allowed_tokens(xgr, grammar)
    for token in tok.encode("ab", add_special_tokens=False):
        assert grammar.accept(token)
    assert allowed_tokens(xgr, grammar) == [eos]
    assert grammar.accept(eos)


def test_the_engine_config_names_the_backend():
    from engine.config import EngineConfig

    assert EngineConfig(structured_outputs_backend="guidance").structured_outputs_backend == "guidance"
    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")


def test_bounded_strings_hold_no_raw_control_characters(tmp_path):
    """xgrammar 0.2.9 lets a string with maxLength hold raw control bytes (invalid JSON); json_ebnf narrows
    them. A byte-level BPE whose tokens include control bytes (the H200 pair's tokenizer) shows it: a random
    walk wrote one in 21 of 30 documents before."""
    from transformers import AutoTokenizer

    from bench.bpe_tokenizer import save_bpe_tokenizer

    save_bpe_tokenizer(8192, 8191, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    schema = {"type": "object", "properties": {"k1": {"type": "array", "items": {"type": "string", "maxLength": 2}},
                                               "k2": {"type": "string", "maxLength": 12}},
              "required": ["k1", "k2"], "additionalProperties": False}
    so = StructuredOutputs(tok, 8192, [8191], backend="xgrammar")
    compiled, rng = so.compile(StructuredOutput(json=json.dumps(schema))), random.Random(0)
    try:
        for _ in range(12):
            text = tok.decode(walk(so, so.new_grammar(compiled), 8191, rng, vocab=8192))
            jsonschema.validate(json.loads(text), schema)
    finally:
        so.shutdown()


@pytest.mark.parametrize("constraint", [
    StructuredOutput(json=json.dumps({"type": "array", "items": {"type": "string", "maxLength": 2}})),
    StructuredOutput(json=json.dumps({"type": "array", "items": {"type": "string"}})),
    StructuredOutput(regex='\\["/..?"'),
    StructuredOutput(regex='\\["/[^x]+"'),
])
def test_no_surrogate_bytes_inside_strings(xgr, tok, constraint):
    """ED A3 BD encodes U+D8FD, a UTF-16 half: not UTF-8. xgrammar 0.2.9 took it for one character (the soak's
    request 59 wrote '["/\\xed\\xa3\\xbd"]' under maxLength 2); safe_ebnf excludes them. ED 95 BF (U+D57F) stays."""
    grammar = xgr.new_grammar(xgr.compile(constraint))
    assert isinstance(grammar, XgrGrammar)
    head = tok.encode('["/', add_special_tokens=False)
    assert all(grammar.accept(t) for t in head)
    bytes_ = tok.convert_tokens_to_ids(["í", "£", "½"])  # GPT-2 byte-level spellings of ED A3 BD
    assert grammar.accept(bytes_[0]) and not grammar.accept(bytes_[1])
    valid = xgr.new_grammar(xgr.compile(constraint))
    assert all(valid.accept(t) for t in head + tok.convert_tokens_to_ids(["í", "Ĺ", "¿"]))


def test_an_xgrammar_that_does_not_import_leaves_every_mask_to_llguidance(tok, monkeypatch):
    """Found but not importable (the GPU host without pydantic): auto uses llguidance, and a JSON schema
    compiles and constrains as before, instead of failing every request in the compile thread."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    grammar_xgr.available.cache_clear()
    try:
        assert not grammar_xgr.available()
        so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id], backend="auto")
        assert not so.use_xgrammar
        grammar = so.new_grammar(so.compile(StructuredOutput(json=json.dumps(SCHEMAS["object"]))))
        assert type(grammar) is Grammar
        assert all(grammar.accept(t) for t in tok.encode('{"name":"ab","age":7}', add_special_tokens=False))
        so.shutdown()
    finally:
        monkeypatch.undo()
        grammar_xgr.available.cache_clear()
    assert grammar_xgr.available()


@pytest.fixture(scope="module")
def bpe_152k(tmp_path_factory):
    """The H100/H200 pair's tokenizer (bench/bpe_tokenizer.py at Qwen2.5's 151,936 ids): its padding tokens
    join two pieces, `","` + newline among them."""
    from transformers import AutoTokenizer

    from bench.bpe_tokenizer import save_bpe_tokenizer

    path = tmp_path_factory.mktemp("bpe152k")
    save_bpe_tokenizer(151936, 151643, path)
    tok = AutoTokenizer.from_pretrained(path)
    so = StructuredOutputs(tok, 151936, [151643], backend="xgrammar")
    yield tok, so
    so.shutdown()


OWNER = {"type": "object", "properties": {"email": {"type": "string"}, "name": {"type": "string", "maxLength": 40}},
         "required": ["email", "name"]}


@pytest.mark.parametrize("head", ['{"email":"a@b.cd","name":":{",', '{"k":"v'])
def test_every_token_a_mask_allows_after_a_string_is_taken(bpe_152k, head):
    """xgrammar 0.2.9's lookahead after a JSON string lets whitespace follow the closing quote, even in compact
    JSON where none may: its mask allowed `","` + newline after an extra key's opening quote (and `"` + newline
    after a value), which the matcher then refused, failing the request (3 of 2,560 at W-B json 100% on an
    H100, twenty-third session). json_ebnf narrows the lookahead (STRING_LOOKAHEAD). Every token the mask
    allows here is taken."""
    tok, so = bpe_152k
    schema = OWNER if head.startswith('{"email"') else {"type": "object"}
    grammar = so.new_grammar(so.compile(StructuredOutput(json=json.dumps(schema))))
    matcher = grammar.matcher
    assert matcher.accept_string(head)
    refused = []
    for token in allowed_tokens(so, grammar, 151936):
        if matcher.accept_token(token):
            matcher.rollback(1)
        else:
            refused.append(tok.convert_ids_to_tokens(token))
    assert not refused, refused[:10]
