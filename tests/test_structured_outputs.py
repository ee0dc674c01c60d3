"""Structured outputs against the real server on a tiny random model: only the grammar mask makes its output
valid. JSON schemas (hypothesis), json_object, regex, choice, grammar; greedy and sampled, n=3, streaming;
bad constraints are fast 400s that leak nothing; the openai client's parse() helper."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_utils import ServerThread, sse_events

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny") as s:
        yield s


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": "tiny", "max_tokens": MAX_TOKENS, **body}, timeout=timeout)


def texts(resp: httpx.Response, chat: bool = False) -> list[str]:
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["message"]["content"] if chat else c["text"] for c in choices]


# ---- schemas a weak model can finish: strings, arrays and numbers are bounded --------------------------

_leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda vals: {"type": "string", "enum": vals},
              st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}-[0-9]{2}$"}),
)


def _object(children):
    def build(props, required_mask):
        names = [f"k{i}" for i in range(len(props))]
        required = [n for n, r in zip(names, required_mask) if r]
        return {"type": "object", "properties": dict(zip(names, props)), "required": required,
                "additionalProperties": False}
    return st.lists(children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(build, st.just(props), st.lists(st.booleans(), min_size=len(props),
                                                                  max_size=len(props))))


def _array(children):
    return st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))


schemas = st.recursive(_leaf, lambda children: st.one_of(_object(children), _array(children)), max_leaves=6)
object_schemas = _object(schemas)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=object_schemas, temperature=st.sampled_from([0.0, 1.0]))
def test_hypothesis_json_schemas_validate(server, schema, temperature):
    resp = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "data please"}], "temperature": temperature, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    for text in texts(resp, chat=True):
        jsonschema.validate(json.loads(text), schema)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("form", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_forms_n3_completions(server, form):
    spec = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
            "structured_outputs": {"json": PERSON}, "guided_json": json.dumps(PERSON)}[form]
    resp = post(server, "/v1/completions", {"prompt": "Person:", "n": 3, "temperature": 1.0, form: spec})
    outs = texts(resp)
    assert len(outs) == 3
    for text in outs:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_sampled(server):
    """Any JSON object. Inside one the random model is free to go on forever, so a logit_bias favours the
    closing tokens: the bias cannot beat the mask (a biased token the grammar forbids stays forbidden), and
    EOS comes only once the object is complete."""
    ids = [httpx.post(server.url("/tokenize"), json={"prompt": t}).json()["tokens"][-1] for t in ('"', "}", ":", "1")]
    for seed in range(3):
        resp = post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "json"}], "temperature": 1.0, "seed": seed,
            "logit_bias": {str(i): 30 for i in ids}, "response_format": {"type": "json_object"}})
        assert isinstance(json.loads(texts(resp, chat=True)[0]), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar(server, temperature):
    regex = r"[a-z]{2,4}-\d{3}( [A-Z][a-z]{0,3})?"
    for text in texts(post(server, "/v1/completions", {"prompt": "id", "n": 2, "temperature": temperature,
                                                       "structured_outputs": {"regex": regex}})):
        assert re.fullmatch(regex, text), text
    choices = ["red", "green", "blue sky"]
    for text in texts(post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "colour?"}], "n": 3, "temperature": temperature,
            "guided_choice": choices}), chat=True):
        assert text in choices
    gbnf = 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3}){0,2} ")"'
    for text in texts(post(server, "/v1/completions", {"prompt": "sum", "temperature": temperature,
                                                       "guided_grammar": gbnf})):
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,2}\)", text), text


def test_streaming_json(server):
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0.7, "seed": 5,
            "messages": [{"role": "user", "content": "stream"}], "structured_outputs": {"json": PERSON}}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=120) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"guided_grammar": 'root ::= "a" [0-9+'}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: a | b"}, "structured_outputs.grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": []}, "structured_outputs.choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens"),
])
def test_bad_constraints_are_fast_400s(server, body, param):
    start = time.monotonic()
    resp = post(server, "/v1/completions", {"prompt": "x", **body})
    assert time.monotonic() - start < 5
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] in ("invalid_grammar", "invalid_value", "unsupported") and err["param"] == param, err


def test_server_keeps_serving_after_bad_constraints(server):
    for _ in range(3):
        assert post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(("}).status_code == 400
    assert texts(post(server, "/v1/completions", {"prompt": "x", "guided_choice": ["ok"]})) == ["ok"]
    assert server.wait_blocks_free() == 0


def test_openai_parse_with_pydantic_model(server):
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        label: str = Field(max_length=6)
        count: int = Field(ge=0, le=99)
        done: bool

    client = OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "item"}],
                                               response_format=Item, max_tokens=MAX_TOKENS, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Item)
    assert 0 <= parsed.count <= 99 and len(parsed.label) <= 6


def test_grammar_limits_refuse_a_schema_too_large(smollm2_tokenizer):
    """--grammar-max-size / --grammar-compile-fuel: past them a schema is a 400, decided in milliseconds."""
    from engine.grammar import GrammarLimits
    from engine.request import StructuredOutput
    from server.errors import APIError
    from server.structured import GrammarChecker

    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "^[a-z]{3,9}$"}
                                            for i in range(300)}}
    for limits in (GrammarLimits(max_grammar_size=500), GrammarLimits(lexer_fuel=2_000)):
        checker = GrammarChecker(smollm2_tokenizer, 49152, limits)
        asyncio.run(checker.check(StructuredOutput(regex="ab?")))  # a small one passes
        start = time.monotonic()
        with pytest.raises(APIError) as err:
            asyncio.run(checker.check(StructuredOutput(json=json.dumps(big))))
        assert err.value.code == "invalid_grammar" and time.monotonic() - start < 2
        checker.shutdown()


def test_a_grammar_the_engine_cannot_follow_is_a_400_not_a_500(server):
    """Found by the schema fuzzer: a regex of odd code points passes the front end's check, then the parser
    gives up mid-generation (ParserTooComplex). That is the request's fault: 400 invalid_grammar, blocks freed."""
    bodies = [{"prompt": [5, 6, 7], "max_tokens": 8, "guided_regex": "\u00f2\ud9cb\udf48\u0014"},
              {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 1.0, "seed": 3,
               "guided_regex": "(\u00f2|\U00102f48)+\u0014"}]
    for body in bodies:
        resp = httpx.post(server.url("/v1/completions"), content=json.dumps(body, ensure_ascii=True),
                          headers={"content-type": "application/json"}, timeout=120)
        assert resp.status_code in (200, 400), resp.text
        if resp.status_code == 400:
            assert resp.json()["error"]["code"] == "invalid_grammar"
    assert server.wait_blocks_free() == 0
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_schema_being_checked_holds_up_no_other_request(server, monkeypatch):
    """A new schema's check runs off the tokenization threads: while two of them are stuck (here on purpose,
    as a large schema is in fact), unconstrained requests are tokenized and answered, and the constrained
    ones go on once their checks end."""
    import server.structured as structured

    release, real_check = threading.Event(), structured.check_grammar

    def slow_check(so, tokenizer, limits):
        release.wait(60)
        return real_check(so, tokenizer, limits)

    monkeypatch.setattr(structured, "check_grammar", slow_check)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(post, server, "/v1/completions", {"prompt": "Hi", "guided_regex": f"a{{{n}}}"})
                       for n in (2, 3)]  # two new constraints: as many as the tokenization threads
        time.sleep(0.5)
        free = [pool.submit(post, server, "/v1/completions", {"prompt": f"Hello {i}"}, 20) for i in range(4)]
        assert all(f.result().status_code == 200 for f in free)
        assert not any(f.done() for f in constrained)
        release.set()
        assert [texts(f.result())[0] for f in constrained] == ["aa", "aaa"]


OPEN_DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}


def _biased_reply(server, strict: bool | None) -> str:
    """A greedy reply under OPEN_DIGIT with `,` (another key next) favoured by far over `}`."""
    comma = httpx.post(server.url("/tokenize"), json={"prompt": ","}).json()["tokens"][-1]
    resp = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "json"}], "temperature": 0, "max_tokens": 24,
        "logit_bias": {str(comma): 30}, "response_format": {"type": "json_schema", "json_schema": {
            "name": "d", "schema": OPEN_DIGIT, **({} if strict is None else {"strict": strict})}}})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


def test_strict_json_schema_takes_no_keys_it_does_not_name(server):
    """OpenAI's `strict: true`: an object without `additionalProperties` takes no other key (so does xgrammar's
    strict mode, vLLM's default). Without strict the same biased reply goes on to a second key, which shows the
    bias would have written one."""
    assert re.fullmatch(r'\{"a":\d,.*', _biased_reply(server, None), re.S)
    for text in [_biased_reply(server, True) for _ in range(2)]:
        assert re.fullmatch(r'\{"a":\d\}', text), text
    assert server.wait_blocks_free() == 0


def test_closed_objects_closes_every_object_and_keeps_what_the_schema_says():
    from server.structured import closed_objects

    schema = {"type": "object", "properties": {
        "list": {"type": "array", "items": {"properties": {"x": {"type": "integer"}}}},
        "either": {"anyOf": [{"type": ["object", "null"]}, {"$ref": "#/$defs/open"}]},
        "map": {"type": "object", "additionalProperties": {"type": "object"}},
        "const": {"const": {"type": "object"}}},
        "$defs": {"open": {"type": "object", "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]  # a $ref is resolved where it points
    assert props["map"]["additionalProperties"] == {"type": "object", "additionalProperties": False}
    assert props["const"]["const"] == {"type": "object"}  # data, not a schema
    assert closed["$defs"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left as it was


ORDERED = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "alpha": {"type": "boolean"}, "mid": {"enum": ["x", "y"]}},
           "required": ["zeta", "alpha", "mid"], "additionalProperties": False}


@pytest.mark.parametrize("form", ["response_format", "structured_outputs", "guided_json"])
def test_properties_come_in_the_schemas_order(server, form):
    """OpenAI's structured outputs write an object's keys in the schema's order (a `reasoning` key before an
    `answer` is why users order them). A schema whose keys are not alphabetical keeps its order, in every form
    of the request (the server once sorted a schema's keys, and the grammar followed them)."""
    extra = {"response_format": {"response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "o", "schema": ORDERED}}},
             "structured_outputs": {"structured_outputs": {"json": ORDERED}},
             "guided_json": {"guided_json": json.dumps(ORDERED)}}[form]
    for text in texts(post(server, "/v1/completions", {"prompt": "A record:", "n": 2, "temperature": 1.0,
                                                       "seed": 5, **extra})):
        assert list(json.loads(text)) == ["zeta", "alpha", "mid"], text
