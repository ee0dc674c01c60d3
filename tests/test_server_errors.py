"""Invalid requests get the right status and an OpenAI-shaped error body; the server keeps serving.

The server here has an API key, small caps and a KV pool (24 blocks x 16 = 384 tokens) smaller than
max_model_len (512), so a prompt can fit the context but not the pool.
"""
from __future__ import annotations

import json

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from server_utils import ServerThread

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), served_model_name="tiny", api_key=KEY, num_kv_blocks=24,
                      max_body_bytes=32768, max_n=4, max_logprobs=5, max_stop_sequences=4,
                      max_stop_length=20) as s:
        yield s


def ok_body(**extra) -> dict:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0, **extra}


def raw(text: str) -> bytes:
    return text.encode("utf-8")


# (id, path, body: dict | bytes, extra headers, status, code)
CASES = [
    ("malformed-json", "/v1/completions", b'{"prompt": ', {}, 400, "invalid_json"),
    ("nan", "/v1/completions", raw('{"prompt": "hi", "temperature": NaN}'), {}, 400, "invalid_json"),
    ("infinity", "/v1/completions", raw('{"prompt": "hi", "top_p": Infinity}'), {}, 400, "invalid_json"),
    ("overflowing-float", "/v1/completions", raw('{"prompt": "hi", "temperature": 1e999}'), {}, 400,
     "invalid_json"),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, "invalid_json"),
    ("body-is-list", "/v1/completions", b"[]", {}, 400, "invalid_json"),
    ("body-is-null", "/v1/completions", b"null", {}, 400, "invalid_json"),
    ("body-is-number", "/v1/completions", b"42", {}, 400, "invalid_json"),
    ("empty-body", "/v1/completions", b"", {}, 400, "invalid_json"),
    ("max-tokens-string", "/v1/completions", ok_body(max_tokens="16"), {}, 400, "invalid_type"),
    ("max-tokens-bool", "/v1/completions", ok_body(max_tokens=True), {}, 400, "invalid_type"),
    ("max-tokens-fraction", "/v1/completions", ok_body(max_tokens=5.5), {}, 400, "invalid_type"),
    ("max-tokens-zero", "/v1/completions", ok_body(max_tokens=0), {}, 400, "invalid_value"),
    ("max-tokens-negative", "/v1/completions", ok_body(max_tokens=-1), {}, 400, "invalid_value"),
    ("max-tokens-huge", "/v1/completions", ok_body(max_tokens=10 ** 12), {}, 400, "context_length_exceeded"),
    ("temperature-negative", "/v1/completions", ok_body(temperature=-0.5), {}, 400, "invalid_value"),
    ("top-p-zero", "/v1/completions", ok_body(top_p=0), {}, 400, "invalid_value"),
    ("top-p-above-one", "/v1/completions", ok_body(top_p=1.5), {}, 400, "invalid_value"),
    ("top-k-below-minus-one", "/v1/completions", ok_body(top_k=-2), {}, 400, "invalid_value"),
    ("top-k-fraction", "/v1/completions", ok_body(top_k=2.5), {}, 400, "invalid_type"),
    ("n-zero", "/v1/completions", ok_body(n=0), {}, 400, "invalid_value"),
    ("n-over-cap", "/v1/completions", ok_body(n=5), {}, 400, "invalid_value"),
    ("prompts-times-n-over-cap", "/v1/completions", ok_body(prompt=["a", "b", "c"], n=2), {}, 400,
     "invalid_value"),
    ("best-of-below-n", "/v1/completions", ok_body(n=2, best_of=1), {}, 400, "invalid_value"),
    ("logprobs-negative", "/v1/completions", ok_body(logprobs=-1), {}, 400, "invalid_value"),
    ("logprobs-over-cap", "/v1/completions", ok_body(logprobs=6), {}, 400, "invalid_value"),
    ("logprobs-over-20", "/v1/completions", ok_body(logprobs=21), {}, 400, "invalid_value"),
    ("echo-with-logprobs-streamed", "/v1/completions", ok_body(echo=True, logprobs=1, stream=True), {}, 400,
     "unsupported"),
    ("prompt-empty-string", "/v1/completions", ok_body(prompt=""), {}, 400, "invalid_value"),
    ("prompt-empty-list", "/v1/completions", ok_body(prompt=[]), {}, 400, "invalid_value"),
    ("prompt-empty-token-list", "/v1/completions", ok_body(prompt=[[]]), {}, 400, "invalid_value"),
    ("prompt-missing", "/v1/completions", {"max_tokens": 2}, {}, 400, "missing_required_parameter"),
    ("prompt-wrong-type", "/v1/completions", ok_body(prompt={"text": "hi"}), {}, 400, "invalid_type"),
    ("prompt-mixed-list", "/v1/completions", ok_body(prompt=[1, "a"]), {}, 400, "invalid_type"),
    ("token-id-negative", "/v1/completions", ok_body(prompt=[1, -3]), {}, 400, "invalid_value"),
    ("token-id-fraction", "/v1/completions", ok_body(prompt=[1, 2.5]), {}, 400, "invalid_type"),
    ("token-id-out-of-vocab", "/v1/completions", ok_body(prompt=[1, 49152]), {}, 400, "invalid_value"),
    ("lone-surrogate", "/v1/completions", raw('{"prompt": "a\\ud800b", "max_tokens": 2}'), {}, 400,
     "invalid_value"),
    ("stop-too-many", "/v1/completions", ok_body(stop=["a", "b", "c", "d", "e"]), {}, 400, "invalid_value"),
    ("stop-empty-string", "/v1/completions", ok_body(stop=[""]), {}, 400, "invalid_value"),
    ("stop-too-long", "/v1/completions", ok_body(stop=["x" * 21]), {}, 400, "invalid_value"),
    ("stop-token-out-of-vocab", "/v1/completions", ok_body(stop_token_ids=[10 ** 6]), {}, 400, "invalid_value"),
    ("logit-bias-bad-key", "/v1/completions", ok_body(logit_bias={"abc": 1}), {}, 400, "invalid_value"),
    ("logit-bias-out-of-vocab", "/v1/completions", ok_body(logit_bias={"99999999": 1}), {}, 400,
     "invalid_value"),
    ("logit-bias-too-big", "/v1/completions", ok_body(logit_bias={"5": 101}), {}, 400, "invalid_value"),
    ("stream-options-without-stream", "/v1/completions", ok_body(stream_options={"include_usage": True}), {},
     400, "invalid_value"),
    ("unknown-model", "/v1/completions", ok_body(model="gpt-17"), {}, 404, "model_not_found"),
    ("prompt-over-context", "/v1/completions", ok_body(prompt=[5] * 513), {}, 400, "context_length_exceeded"),
    ("prompt-plus-max-tokens-over-context", "/v1/completions", ok_body(prompt=[5] * 500, max_tokens=13), {},
     400, "context_length_exceeded"),
    ("prompt-over-kv-pool", "/v1/completions", ok_body(prompt=[5] * 450), {}, 400, "context_length_exceeded"),
    ("wrong-content-type", "/v1/completions", raw(json.dumps(ok_body())), {"Content-Type": "text/plain"}, 415,
     "unsupported_media_type"),
    ("body-over-limit", "/v1/completions", ok_body(prompt="x" * 40000), {}, 413, "request_too_large"),
    ("chat-no-messages", "/v1/chat/completions", {"messages": []}, {}, 400, "invalid_value"),
    ("chat-bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400,
     "invalid_type"),
    ("chat-content-wrong-type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, {}, 400,
     "invalid_type"),
    ("chat-top-logprobs-over-cap", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6}, {}, 400,
     "invalid_value"),
    ("tokenize-null-prompt", "/tokenize", {"prompt": None}, {}, 400, "invalid_type"),
    ("tokenize-neither", "/tokenize", {}, {}, 400, "invalid_value"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [49152]}, {}, 400, "invalid_value"),
]


def check_error_shape(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"]
    assert len(resp.content) < 1000  # never the whole input echoed back
    return err


@pytest.mark.parametrize("name,path,body,headers,status,code", CASES, ids=[c[0] for c in CASES])
def test_invalid_request(server, name, path, body, headers, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.url(path), content=content, headers={**JSON, **headers}, timeout=30)
    check_error_shape(resp, status, code)


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]},
     "messages.1.content", "must be a string or a list of text parts"),
    ("/v1/completions", ok_body(prompt={"text": "hi"}), "prompt", "must be a string, a list of strings"),
    ("/v1/completions", ok_body(stop=5), "stop", "must be a string or a list of strings")])
def test_a_value_of_no_member_of_a_union_is_named_by_its_path(server, path, body, param, says):
    """A value that fits no member of a union field (chat content, prompt, stop) gets one message listing
    what the field takes, at the field's path: not pydantic's error for the union's first member."""
    err = check_error_shape(httpx.post(server.url(path), json=body, headers=AUTH, timeout=30), 400, "invalid_type")
    assert err["param"] == param and err["message"].startswith(f"{param}: {says}"), err


def test_server_still_serves_after_the_invalid_requests(server):
    resp = httpx.post(server.url("/v1/completions"), json=ok_body(), headers=AUTH, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    assert server.wait_blocks_free() == 0
    assert server.metrics()["kvserve_idle_invariant_violations_total"] == 0


def test_chunked_body_over_limit_without_content_length(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 8192
        yield b'"}'

    resp = httpx.post(server.url("/v1/completions"), content=chunks(), headers=JSON, timeout=30)
    assert "content-length" not in resp.request.headers
    check_error_shape(resp, 413, "request_too_large")


def test_get_on_post_route_is_405_with_allow(server):
    resp = httpx.get(server.url("/v1/completions"), headers=AUTH)
    check_error_shape(resp, 405, "method_not_allowed")
    assert resp.headers["allow"] == "POST"
    check_error_shape(httpx.get(server.url("/no/such/route"), headers=AUTH), 404, "not_found")


def test_unknown_fields_are_ignored_and_model_is_optional(server):
    body = {"prompt": "Hello", "max_tokens": 2, "frobnicate": {"x": [1, 2]}, "temperature": 0}
    resp = httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=30)
    assert resp.status_code == 200
    assert resp.json()["model"] == "tiny"


def test_nul_characters_are_text(server):
    resp = httpx.post(server.url("/v1/completions"), json=ok_body(prompt="a\u0000b"), headers=AUTH, timeout=30)
    assert resp.status_code == 200


def test_long_input_is_not_echoed(server):
    resp = httpx.post(server.url("/v1/completions"), json=ok_body(model="m" * 20000), headers=AUTH, timeout=30)
    err = check_error_shape(resp, 413, "request_too_large") if resp.status_code == 413 else None
    if err is None:
        err = check_error_shape(resp, 404, "model_not_found")
        assert "m" * 200 not in err["message"]


def test_api_key_required(server):
    url = server.url("/v1/completions")
    check_error_shape(httpx.post(url, json=ok_body()), 401, "invalid_api_key")
    check_error_shape(httpx.post(url, json=ok_body(), headers={"Authorization": "Bearer wrong"}), 401,
                      "invalid_api_key")
    check_error_shape(httpx.post(url, json=ok_body(), headers={"Authorization": KEY}), 401, "invalid_api_key")
    for path in ("/v1/models", "/v1/models/tiny", "/v1/models/nope", "/tokenize", "/detokenize"):
        method = httpx.get if path.startswith("/v1/models") else httpx.post
        assert method(server.url(path)).status_code == 401
    for path in ("/health", "/ping", "/ready", "/metrics", "/version"):
        assert httpx.get(server.url(path)).status_code == 200
    for path in ("/health", "/ready"):  # probes that send HEAD (load balancers, curl -I) get the status alone
        head = httpx.head(server.url(path))
        assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "application/json"
    assert httpx.post(server.url("/ping")).json()["status"] == "ok"
    assert httpx.post(url, json=ok_body(), headers={"X-API-Key": KEY}, timeout=30).status_code == 200


def test_api_key_with_the_openai_client(server):
    good = OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None
    assert good.models.retrieve("tiny").id == "tiny"
    bad = OpenAI(base_url=server.url("/v1"), api_key="nope", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    with pytest.raises(AuthenticationError):
        bad.models.retrieve("tiny")
