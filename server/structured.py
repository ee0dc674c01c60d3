"""Structured outputs on the HTTP side: a request's constraint fields -> engine.request.StructuredOutput, and a
check of its grammar (in a thread of its own, LRU-cached) so that a bad schema, regex or grammar is a 400
`invalid_grammar` before anything reaches the engine core. The core compiles and enforces it (engine/structured.py).
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from engine.grammar import LRU, GrammarLimits, check_grammar, llg_tokenizer
from engine.request import RequestError, StructuredOutput
from server.errors import APIError

CHECK_CACHE_SIZE = 1024
# Subschemas by keyword: a schema, a list of schemas, or a mapping of names to schemas (closed_objects walks them).
SCHEMA_KEYWORDS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                   "unevaluatedProperties", "unevaluatedItems")
SCHEMA_LIST_KEYWORDS = ("prefixItems", "anyOf", "oneOf", "allOf")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", code, param)


def _schema_text(schema, param: str) -> str:
    """A schema (object, or its JSON text) -> its JSON text, keys in the order given: the grammar engines emit an
    object's properties in the schema's order, as OpenAI's structured outputs do (a `reasoning` key before an
    `answer`). Sorted keys, as before, made W-B's record schema come out alphabetically (`{"id":..,"owner":..`)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise _bad(param, "must be a JSON schema (an object, or its JSON text)", "invalid_grammar") from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(param, "must be a JSON schema (an object)", "invalid_grammar")
    return json.dumps(schema)


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema (one with `type: object` or
    `properties`) that does not set it, at every depth: what `strict: true` means (OpenAI's structured outputs
    refuse extra keys under it; xgrammar's strict mode, vLLM's default, does the same). Without it llguidance
    (the quick-start install's only grammar engine) let a strict reply carry a key the schema does not name."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed_child(key, value) for key, value in schema.items()}
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _closed_child(key: str, value):
    if key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
        return {name: closed_objects(sub) for name, sub in value.items()}
    if key in SCHEMA_KEYWORDS or key in SCHEMA_LIST_KEYWORDS:
        return closed_objects(value)
    return value  # a value (enum, const, default, ...) is data, not a schema


def _from_response_format(rf) -> StructuredOutput | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise _bad("response_format.json_schema", "json_schema with a `schema` is required for type json_schema")
    schema = rf.json_schema.schema_
    if rf.json_schema.strict:
        schema = closed_objects(schema)
    return StructuredOutput(json=_schema_text(schema, "response_format.json_schema.schema"))


def _from_structured_outputs(so) -> StructuredOutput:
    return StructuredOutput(
        json=None if so.json_ is None else _schema_text(so.json_, "structured_outputs.json"),
        json_object=bool(so.json_object), regex=so.regex, choice=so.choice, grammar=so.grammar)


def _from_guided(req) -> StructuredOutput:
    return StructuredOutput(json=None if req.guided_json is None else _schema_text(req.guided_json, "guided_json"),
                            regex=req.guided_regex, choice=req.guided_choice, grammar=req.guided_grammar)


def structured_output(req) -> StructuredOutput | None:
    """The request's one constraint, or None. Two ways of asking at once is a 400."""
    guided = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
              if getattr(req, n) is not None]
    given = [n for n, v in (("response_format", req.response_format), ("structured_outputs", req.structured_outputs))
             if v is not None] + guided
    if len(given) > 1:
        raise _bad(given[1], f"give one constraint; {given[0]} is already given", "invalid_value")
    if not given:
        return None
    if req.response_format is not None:
        so = _from_response_format(req.response_format)
    elif req.structured_outputs is not None:
        so = _from_structured_outputs(req.structured_outputs)
    else:
        so = _from_guided(req)
    if so is not None:
        try:
            so.validate()
        except RequestError as err:
            raise APIError(400, err.message, err.code, err.param) from None
    return so


class GrammarChecker:
    """Validates constraints against the served tokenizer within the engine's limits, in a thread of its own:
    a new schema's check (tens to hundreds of ms; the llguidance tokenizer is built on first use, ~0.4 s for
    49k tokens) never holds up the tokenization of other requests. With it in the tokenization threads, two
    constrained requests of a new schema held every other request of a smoke W-B 20% load ~170 ms. Requests
    with one constraint share its check. Called from the event loop only."""

    def __init__(self, hf_tokenizer, vocab_size: int, limits: GrammarLimits) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self._tokenizer = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-check")
        self._checked = LRU(CHECK_CACHE_SIZE)  # key -> Future of None (valid) or the APIError

    async def check(self, so: StructuredOutput) -> None:
        """Raises APIError 400 (invalid_grammar) for a constraint the engine would refuse."""
        key = so.key()
        future = self._checked.get(key)
        if future is None:
            future = self._pool.submit(self._validate, so)
            self._checked.put(key, future)
        try:
            error = await asyncio.wrap_future(future)
        except Exception:  # not a verdict on the constraint (a bug, a shutdown): the next request checks anew
            self._checked.drop(key)
            raise
        if error:
            raise error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _validate(self, so: StructuredOutput) -> APIError | None:
        if self.hf_tokenizer is None:
            return APIError(400, "structured outputs need a tokenizer, and this server runs without one",
                            "unsupported", so.param())
        if self._tokenizer is None:
            eos = self.hf_tokenizer.eos_token_id
            self._tokenizer = llg_tokenizer(self.hf_tokenizer, self.vocab_size, [] if eos is None else [eos])
        try:
            check_grammar(so, self._tokenizer, self.limits)
        except RequestError as err:
            return APIError(400, err.message, err.code, err.param)
        return None
