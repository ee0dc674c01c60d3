"""Schema fuzzing: schemathesis generates requests (valid and invalid) for every operation of the live
server's /openapi.json; no response may be a 5xx, and every response must conform to the schema: a
declared status code, a declared content type, a body matching the declared model (error responses
included).

Bounded: a fixed number of examples per operation, no shrinking, and a tiny model with a short context,
so the whole module runs in well under 90 s.
"""
from __future__ import annotations

import json

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from server_utils import ServerThread, parse_metrics

EXAMPLES_PER_OPERATION = 20


def is_sse(response) -> bool:
    return any(v.startswith("text/event-stream") for v in response.headers.get("content-type", []))


def sse_events_conform(response) -> None:
    """A stream is `data:` events of chunk or error objects, then `data: [DONE]`. (schemathesis reads at
    most 20 events and then hangs up: a stream it cut short has no [DONE] yet.)"""
    data = [ln[6:] for ln in response.content.decode("utf-8").split("\n") if ln.startswith("data: ")]
    if not response.stream_cut_short:
        assert data and data[-1] == "[DONE]", data[-3:]
    for i, payload in enumerate(data):
        if payload == "[DONE]":
            assert i == len(data) - 1, "events after [DONE]"
            continue
        event = json.loads(payload)
        if "error" in event:
            assert set(event["error"]) == {"message", "type", "param", "code"}, event
            continue
        assert event["object"] in ("text_completion", "chat.completion.chunk"), event
        assert isinstance(event["choices"], list) and isinstance(event["id"], str), event


@schemathesis.check
def response_conformance(ctx, response, case):
    """The declared response schema; SSE bodies by their event framing (see test_sse_schema_is_declared)."""
    if is_sse(response):
        sse_events_conform(response)
        return None
    return response_schema_conformance(ctx, response, case)


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_conformance]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A 48-token context bounds every generation; most generated max_tokens exceed it (400), small ones run.
    with ServerThread(tiny_model_dir("llama"), max_model_len=48, max_n=2, max_body_bytes=256 << 10) as s:
        yield s
        s.wait_blocks_free()
        m = parse_metrics(httpx.get(s.url("/metrics")).text)
        assert m["kvserve_kv_blocks_used"] == 0
        assert m["kvserve_idle_invariant_violations_total"] == 0


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url("/openapi.json"))


# schemathesis' own pytest integration (from_fixture + parametrize) does not run under pytest 9; its
# Python API does: one Hypothesis test per operation and generation mode.
OPERATIONS = ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
              "GET /v1/models", "GET /v1/models/{model}", "GET /health", "GET /ready", "GET /metrics",
              "GET /version")


def test_every_operation_is_fuzzed(api_schema):
    found = {op.ok().label for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


WITH_BODY = [label for label in OPERATIONS if label.startswith("POST")]
CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [  # operations without parameters have
    (label, GenerationMode.NEGATIVE) for label in WITH_BODY]  # no invalid form


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label}-{mode.value}" for label, mode in CASES])
def test_api_conforms_and_never_5xx(api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)
    session = requests.Session()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(session=session, checks=CHECKS, timeout=60)

    fuzz()


def test_sse_schema_is_declared(api_schema, server):
    """A streamed response checked against what the schema declares for text/event-stream: each event
    (OpenAPI 3.1: `schema` describes one event, an object with a `data` string)."""
    for label, body in (("POST /v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}),
                        ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 3, "stream": True})):
        case = api_schema.find_operation_by_label(label).Case(body=body, media_type="application/json")
        response = case.call(timeout=60)
        assert response.status_code == 200 and is_sse(response)
        case.validate_response(response, checks=[response_schema_conformance])


def test_schema_declares_error_responses(api_schema, server):
    """Every generating route declares its errors with the OpenAI error body, so the fuzzer can check them."""
    raw = httpx.get(server.url("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = raw["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "413", "415", "429", "500", "503"):
            body = responses[status]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/ErrorResponse"}, (path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "408" in raw["paths"][path]["post"]["responses"]
        assert "text/event-stream" in raw["paths"][path]["post"]["responses"]["200"]["content"]
