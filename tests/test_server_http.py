"""HTTP-level behaviour that needs no model: CORS, the loading state, the JSON parser, error shapes.

The app is driven in-process (Starlette's TestClient) with an engine that is still loading.
"""
from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from server.app import create_app, parse_json_object
from engine.core.process import CoreAddresses
from server.engine_client import CoreConnection, CoreEndpoint, EngineClient
from server.errors import APIError
from server.settings import ServerSettings


def loading_app(**settings):
    """An app whose engine core never answers (no core process listens on its addresses): it stays loading.
    Returns the app and a function that removes the addresses' folder."""
    addresses = CoreAddresses.new(1)
    client = EngineClient(CoreConnection([CoreEndpoint(addresses)]), ServerSettings(**settings))
    folder = addresses.inbox[len("ipc://"):].rsplit("/", 1)[0]
    return create_app(client, client.settings), lambda: shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def client():
    app, release = loading_app()
    with TestClient(app) as c:
        yield c
        release()


def test_loading_state(client):
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["detail"] == "loading" and ready.headers["retry-after"]
    assert client.get("/health").status_code == 200  # alive, just not ready
    resp = client.post("/v1/completions", json={"prompt": "hi"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "not_ready"
    assert resp.headers["retry-after"] == "1"
    assert client.get("/metrics").status_code == 200


def test_cors_is_off_by_default(client):
    preflight = client.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                           "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    plain = client.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in plain.headers


def test_cors_origins_when_configured():
    app, release = loading_app(cors_origins=["http://ok.example"], api_key="k")
    with TestClient(app) as c:
        ok = c.options("/v1/completions", headers={"Origin": "http://ok.example",
                                                   "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"
        other = c.options("/v1/completions", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
        assert c.get("/health", headers={"Origin": "http://ok.example"}).headers[
            "access-control-allow-origin"] == "http://ok.example"
        release()


@pytest.mark.parametrize("raw", [b"{", b"\xc3\x28", b"[1]", b"null", b"\"x\"", b"{\"a\": NaN}",
                                 b"{\"a\": -Infinity}", b"{\"a\": 1e400}", b"[" * 100000])
def test_json_parser_refuses(raw):
    with pytest.raises(APIError) as err:
        parse_json_object(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"
    assert len(err.value.message) < 400


def test_json_parser_accepts_objects():
    assert parse_json_object(b'{"a": [1, 2.5, "\\u00e9"], "b": null}') == {"a": [1, 2.5, "é"], "b": None}


def test_error_bodies_are_openai_shaped(client):
    for resp in (client.get("/nope"), client.get("/v1/completions"), client.put("/health"),
                 client.post("/v1/completions", content=b"x" * 10, headers={"content-type": "text/plain"})):
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert set(client.put("/health").headers["allow"].split(", ")) == {"GET", "HEAD"}


def test_oversized_headers_are_431(client):
    resp = client.get("/health", headers={"X-Big": "a" * 40000})
    assert resp.status_code == 431
    assert resp.json()["error"]["code"] == "request_header_fields_too_large"
    assert client.get("/health", headers={"X-Fine": "a" * 1000}).status_code == 200


def test_max_tokens_cap_lowers_defaults_and_refuses_more():
    from server import protocol as P
    from server import request_params as RP

    limits = RP.Limits(vocab_size=100, max_n=4, max_logprobs=5, max_stop_sequences=4, max_stop_length=10,
                      max_tokens_cap=8)
    completion = P.CompletionRequest.model_validate({"prompt": "x"})
    assert RP.completion_params(completion, limits).max_tokens == 8  # the default 16, lowered to the cap
    chat = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert RP.chat_params(chat, limits).max_tokens == 8  # chat's default (no limit), lowered to the cap
    small = P.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 3})
    assert RP.completion_params(small, limits).max_tokens == 3
    with pytest.raises(APIError) as err:
        RP.completion_params(P.CompletionRequest.model_validate({"prompt": "x", "max_tokens": 9}), limits)
    assert err.value.code == "invalid_value" and err.value.param == "max_tokens"
    uncapped = RP.Limits(**{**limits.__dict__, "max_tokens_cap": None})
    assert RP.completion_params(completion, uncapped).max_tokens == 16
    assert RP.chat_params(chat, uncapped).max_tokens is None
