"""Hostile input against the real server: every case gets its documented status and error code, quickly,
without echoing the input back; afterwards a normal request succeeds and no KV block is left held.

One server per module (a tiny llama, max_model_len 128, a 64 KiB body limit) and a second one whose
whole KV pool (64 tokens) is smaller than max_model_len. Raw-socket cases cover what an HTTP client
library would not send: a chunked body over the limit, a lying Content-Length, oversized headers.
Also here: the Docker image does not run as root.
"""
from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from server_utils import ServerThread, parse_metrics

MAX_MODEL_LEN = 128
VOCAB = 49152  # the tiny models use SmolLM2's tokenizer
BODY_LIMIT = 64 << 10
ERROR_BODY_LIMIT = 2048  # an error body is short whatever the input was
ANY_400 = ("invalid_value", "invalid_type", "invalid_json", "missing_required_parameter")

C, CHAT = "/v1/completions", "/v1/chat/completions"



def ids(n: int, start: int = 100) -> list[int]:
    return [start + i % 1000 for i in range(n)]


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    codes: tuple[str, ...] = ()  # acceptable error codes; empty for a success
    body: object = None  # a JSON value, sent with Content-Type: application/json
    raw: bytes | None = None  # sent as is instead of `body`
    path: str = C
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    max_seconds: float = 10.0
    total_tokens: int | None = None  # successes: prompt + completion tokens the usage must show


def c(name, status, codes, body=None, **kw) -> Case:
    codes = (codes,) if isinstance(codes, str) else tuple(codes or ())
    return Case(name, status, codes, body, **kw)


def prompt(**kw) -> dict:
    return {"prompt": "Hello there", "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}


JSON_CASES = [
    # lengths: context, KV pool, body size
    c("prompt_ids_at_context_length", 400, "context_length_exceeded", prompt(prompt=ids(MAX_MODEL_LEN))),
    c("prompt_ids_over_context_length", 400, "context_length_exceeded", prompt(prompt=ids(MAX_MODEL_LEN + 1))),
    c("prompt_text_over_context_length", 400, "context_length_exceeded", prompt(prompt="hello " * 400)),
    c("prompt_plus_max_tokens_over", 400, "context_length_exceeded",
      prompt(prompt=ids(MAX_MODEL_LEN - 4), max_tokens=5)),
    c("prompt_plus_max_tokens_exactly_at", 200, None,
      prompt(prompt=ids(MAX_MODEL_LEN - 4), max_tokens=4, ignore_eos=True), total_tokens=MAX_MODEL_LEN),
    c("chat_max_tokens_over_context", 400, "context_length_exceeded", chat(max_tokens=MAX_MODEL_LEN), path=CHAT),
    c("text_just_under_body_limit", 400, "context_length_exceeded",
      prompt(prompt="lorem ipsum " * ((BODY_LIMIT - 100) // 12))),
    c("ten_megabytes_of_text", 413, "request_too_large", prompt(prompt="a" * (10 << 20))),
    # max_tokens
    c("max_tokens_zero", 400, "invalid_value", prompt(max_tokens=0)),
    c("max_tokens_negative", 400, "invalid_value", prompt(max_tokens=-1)),
    c("max_tokens_10_to_12", 400, "context_length_exceeded", prompt(max_tokens=10 ** 12)),
    c("max_tokens_fractional", 400, "invalid_type", prompt(max_tokens=5.5)),
    c("max_tokens_true", 400, "invalid_type", prompt(max_tokens=True)),
    c("max_tokens_string", 400, "invalid_type", prompt(max_tokens="16")),
    c("max_tokens_null_is_default", 200, None, prompt(max_tokens=None)),
    # sampling parameters
    c("temperature_negative", 400, "invalid_value", prompt(temperature=-0.5)),
    c("temperature_nan", 400, "invalid_json", raw=b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'),
    c("temperature_infinity", 400, "invalid_json",
      raw=b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}'),
    c("temperature_overflowing_literal", 400, ("invalid_json", "invalid_value"),
      raw=b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}'),
    c("temperature_string", 400, "invalid_type", prompt(temperature="0.5")),
    c("top_p_zero", 400, "invalid_value", prompt(top_p=0)),
    c("top_p_above_one", 400, "invalid_value", prompt(top_p=1.5)),
    c("top_p_nan", 400, "invalid_json", raw=b'{"prompt": "hi", "max_tokens": 2, "top_p": NaN}'),
    c("top_k_below_minus_one", 400, "invalid_value", prompt(top_k=-2)),
    c("top_k_fractional", 400, "invalid_type", prompt(top_k=2.5)),
    c("n_zero", 400, "invalid_value", prompt(n=0)),
    c("n_above_cap", 400, "invalid_value", prompt(n=17)),
    c("n_times_prompts_above_cap", 400, "invalid_value", prompt(prompt=["a"] * 9, n=2)),
    c("best_of_below_n", 400, "invalid_value", prompt(n=2, best_of=1)),
    c("presence_penalty_out_of_range", 400, "invalid_value", prompt(presence_penalty=3)),
    c("seed_beyond_int64", 400, "invalid_value", prompt(seed=2 ** 64)),
    c("logit_bias_key_not_a_token", 400, "invalid_value", prompt(logit_bias={"abc": 1})),
    c("logit_bias_key_out_of_vocab", 400, "invalid_value", prompt(logit_bias={str(VOCAB): 1})),
    c("logit_bias_value_out_of_range", 400, "invalid_value", prompt(logit_bias={"100": 1000})),
    c("min_tokens_above_max_tokens", 400, "invalid_value", prompt(min_tokens=5, max_tokens=2)),
    c("ignore_eos_string", 400, "invalid_type", prompt(ignore_eos="yes")),
    c("timeout_negative", 400, "invalid_value", prompt(timeout=-1)),
    # prompts
    c("prompt_empty_string", 400, "invalid_value", prompt(prompt="")),
    c("prompt_empty_list", 400, "invalid_value", prompt(prompt=[])),
    c("prompt_list_of_empty_list", 400, "invalid_value", prompt(prompt=[[]])),
    c("token_id_negative", 400, ("invalid_value", "invalid_type"), prompt(prompt=[5, -1])),
    c("token_id_fractional", 400, "invalid_type", prompt(prompt=[5, 1.5])),
    c("token_id_out_of_vocab", 400, "invalid_value", prompt(prompt=[5, VOCAB])),
    c("token_id_far_out_of_vocab", 400, "invalid_value", prompt(prompt=[[5], [10 ** 15]])),
    c("prompt_number", 400, "invalid_type", prompt(prompt=42)),
    c("prompt_object", 400, "invalid_type", prompt(prompt={"text": "hi"})),
    c("prompt_mixed_list", 400, "invalid_type", prompt(prompt=["a", 1])),
    c("prompt_missing", 400, "missing_required_parameter", {"max_tokens": 2}),
    c("prompt_lone_surrogate", 400, "invalid_value", raw=b'{"prompt": "ab\\ud800cd", "max_tokens": 2}'),
    c("prompt_nul_characters_served", 200, None, prompt(prompt="a\u0000b\u0000")),
    c("chat_lone_surrogate", 400, "invalid_value",
      raw=b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', path=CHAT),
    # stop, logprobs, stream options
    c("stop_empty_list_served", 200, None, prompt(stop=[])),
    c("stop_empty_string", 400, "invalid_value", prompt(stop=[""])),
    c("stop_too_many", 400, "invalid_value", prompt(stop=[f"s{i}" for i in range(17)])),
    c("stop_thousands", 400, "invalid_value", prompt(stop=[f"stop-{i}" for i in range(3000)])),
    c("stop_too_long", 400, "invalid_value", prompt(stop=["x" * 257])),
    c("stop_token_ids_negative", 400, ("invalid_value", "invalid_type"), prompt(stop_token_ids=[-1])),
    c("logprobs_negative", 400, "invalid_value", prompt(logprobs=-1)),
    c("logprobs_above_20", 400, "invalid_value", prompt(logprobs=21)),
    c("chat_top_logprobs_above_20", 400, "invalid_value", chat(logprobs=True, top_logprobs=21), path=CHAT),
    c("stream_options_without_stream", 400, "invalid_value", prompt(stream_options={"include_usage": True})),
    # model and fields
    c("unknown_model", 404, "model_not_found", prompt(model="gpt-17")),
    c("missing_model_served", 200, None, prompt()),
    c("unknown_fields_ignored", 200, None, prompt(frobnicate=1, another={"x": [1]})),
    # chat shapes
    c("chat_messages_empty", 400, "invalid_value", chat(messages=[]), path=CHAT),
    c("chat_role_unknown", 400, "invalid_type", chat(messages=[{"role": "wizard", "content": "hi"}]), path=CHAT),
    c("chat_content_number", 400, "invalid_type", chat(messages=[{"role": "user", "content": 7}]), path=CHAT),
    c("chat_messages_missing", 400, "missing_required_parameter", {"max_tokens": 2}, path=CHAT),
    # bodies that are not a JSON object
    c("malformed_json", 400, "invalid_json", raw=b'{"prompt": "hi", "max_tokens": 2'),
    c("trailing_garbage", 400, "invalid_json", raw=b'{"prompt": "hi"} {"x": 1}'),
    c("empty_body", 400, "invalid_json", raw=b""),
    c("invalid_utf8", 400, "invalid_json", raw=b'{"prompt": "caf\xc3\x28 \xff\xfe", "max_tokens": 2}'),
    c("body_is_list", 400, "invalid_json", []),
    c("body_is_null", 400, "invalid_json", raw=b"null"),
    c("body_is_number", 400, "invalid_json", raw=b"42"),
    c("deeply_nested_json", 400, ANY_400, raw=b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"),
    # content types, methods, routes
    c("content_type_text_plain", 415, "unsupported_media_type", prompt(), headers={"content-type": "text/plain"}),
    c("content_type_form", 415, "unsupported_media_type", raw=b"prompt=hi",
      headers={"content-type": "application/x-www-form-urlencoded"}),
    c("get_on_post_route", 405, "method_not_allowed", method="GET"),
    c("unknown_route", 404, "not_found", prompt(), path="/v1/nothing-here"),
    c("tokenize_prompt_number", 400, "invalid_type", {"prompt": 42}, path="/tokenize"),
    c("detokenize_out_of_vocab", 400, "invalid_value", {"tokens": [1, VOCAB + 7]}, path="/detokenize"),
]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), max_model_len=MAX_MODEL_LEN, max_body_bytes=BODY_LIMIT,
                      max_n=16, max_stop_sequences=16, max_stop_length=256, max_num_seqs=8) as s:
        card = httpx.get(s.url("/v1/models")).json()["data"][0]
        assert card["max_model_len"] == MAX_MODEL_LEN
        yield s
        assert s.metrics()["kvserve_idle_invariant_violations_total"] == 0


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def baseline(client) -> float:
    """kvserve_kv_blocks_used of the idle server, before any hostile case."""
    return metrics(client)["kvserve_kv_blocks_used"]


@pytest.fixture(scope="module")
def small_pool_server(tiny_model_dir):
    # 4 blocks of 16 tokens: the whole pool holds 64 tokens, half of max_model_len. max_tokens capped at 8.
    with ServerThread(tiny_model_dir("llama"), max_model_len=MAX_MODEL_LEN, num_kv_blocks=4, block_size=16,
                      max_tokens_cap=8) as s:
        yield s


# ------------------------------------------------------------------------------------------ helpers


def engine_thread_cpu(server: ServerThread) -> float:
    """CPU seconds the engine-core process has used."""
    times = psutil.Process(server.core_pid).cpu_times()
    return times.user + times.system


def assert_engine_sleeps(server: ServerThread, seconds: float = 0.5) -> None:
    """An idle server's engine thread sleeps: a refused request left behind in the engine would keep it
    stepping (empty steps, which no step counter shows) and burning a core."""
    assert server.wait_blocks_free() == 0
    time.sleep(0.1)  # the last step and the busy -> idle check
    before = engine_thread_cpu(server)
    time.sleep(seconds)
    assert engine_thread_cpu(server) - before < 0.2 * seconds, "the engine thread spins while idle"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def json(self):
        return json.loads(self.body)


def metrics(client: httpx.Client) -> dict[str, float]:
    return parse_metrics(client.get("/metrics").text)


def wait_blocks(client: httpx.Client, value: float, timeout: float = 20.0) -> float:
    """Polls kvserve_kv_blocks_used until it equals `value`; returns the last reading."""
    end = time.monotonic() + timeout
    while (used := metrics(client)["kvserve_kv_blocks_used"]) != value and time.monotonic() < end:
        time.sleep(0.02)
    return used


def send_case(client: httpx.Client, case: Case) -> Reply:
    headers = {"content-type": "application/json", **case.headers}
    content = case.raw if case.raw is not None else (None if case.body is None else json.dumps(case.body).encode())
    start = time.monotonic()
    r = client.request(case.method, case.path, content=content, headers=headers)
    return Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content, time.monotonic() - start)


def assert_error_shape(reply: Reply, status: int, codes: tuple[str, ...]) -> dict:
    assert reply.status == status, reply.body[:500]
    assert reply.headers.get("content-type", "").startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] in codes, err
    return err


def assert_no_echo(reply: Reply, sent: bytes | None) -> None:
    assert len(reply.body) <= ERROR_BODY_LIMIT, f"{len(reply.body)}-byte error body"
    if sent and len(sent) > 200:
        assert sent not in reply.body


def assert_recovered(client: httpx.Client, baseline: float) -> None:
    """A normal request succeeds and kvserve_kv_blocks_used is back to its baseline."""
    r = client.post(C, json={"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert wait_blocks(client, baseline) == baseline
    m = metrics(client)
    assert m["kvserve_requests_running"] == 0 and m["kvserve_requests_waiting"] == 0


def raw_exchange(port: int, chunks, timeout: float = 20.0) -> Reply | None:
    """Send raw bytes (an iterable of chunks; stops early if the server closes) and read one response.
    None when the server reset the connection instead (it may, closing with our bytes unread)."""
    start = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: read what it said
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
            body = resp.read()
        except ConnectionResetError:
            return None
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body, time.monotonic() - start)
    finally:
        sock.close()


def request_head(path: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}\r\n").encode()


def http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def chunked_body_over_limit():
    yield request_head(C, "Transfer-Encoding: chunked\r\n")
    yield http_chunk(b'{"prompt": "')
    piece = http_chunk(b"a" * 16384)
    for _ in range(BODY_LIMIT // 16384 * 4):  # 4x the limit, never announced in a Content-Length
        yield piece
    yield http_chunk(b'"}') + b"0\r\n\r\n"


# ------------------------------------------------------------------------------------------ the cases


def test_at_least_fifty_cases():
    assert len(JSON_CASES) + len(RAW_CASES) + 1 >= 50  # + the KV-pool case below
    assert len({case.name for case in JSON_CASES}) == len(JSON_CASES)


@pytest.mark.parametrize("case", JSON_CASES, ids=lambda case: case.name)
def test_hostile_request(client, baseline, case: Case):
    reply = send_case(client, case)
    assert reply.seconds < case.max_seconds, f"took {reply.seconds:.1f} s"
    if case.status == 200:
        assert reply.status == 200, reply.body[:500]
        body = reply.json()
        assert body["choices"] and all(ch["finish_reason"] in ("stop", "length") for ch in body["choices"])
        if case.total_tokens is not None:
            assert body["usage"]["total_tokens"] == case.total_tokens
    else:
        err = assert_error_shape(reply, case.status, case.codes)
        sent = case.raw if case.raw is not None else json.dumps(case.body).encode()
        assert_no_echo(reply, sent)
        if case.status == 405:
            assert "POST" in reply.headers.get("allow", ""), reply.headers
        if case.codes == ("context_length_exceeded",):
            assert str(MAX_MODEL_LEN) in err["message"]
    assert_recovered(client, baseline)


def test_prompt_larger_than_whole_kv_pool_is_refused_at_once(small_pool_server):
    s = small_pool_server
    before = s.metrics()
    assert before["kvserve_kv_blocks_total"] * 16 < MAX_MODEL_LEN
    start = time.monotonic()
    r = httpx.post(s.url(C), json=prompt(prompt=ids(80), max_tokens=1), timeout=30)
    seconds = time.monotonic() - start
    reply = Reply(r.status_code, dict(r.headers), r.content, seconds)
    assert_error_shape(reply, 400, ("context_length_exceeded",))
    assert seconds < 5
    after = s.metrics()
    # Never queued: nothing waits, and the engine counted no prompt tokens for it.
    assert after["kvserve_requests_waiting"] == 0
    assert after["kvserve_prompt_tokens_total"] == before["kvserve_prompt_tokens_total"]
    ok = httpx.post(s.url(C), json=prompt(prompt=ids(20), max_tokens=4), timeout=60)
    assert ok.status_code == 200, ok.text
    assert s.wait_blocks_free() == 0


@pytest.mark.parametrize("path,body", [(C, {"prompt": "Hi"}), (C, {"prompt": "Hi", "max_tokens": None}),
                                       (CHAT, {"messages": [{"role": "user", "content": "Hi"}]})],
                         ids=["completions_omitted", "completions_null", "chat_omitted"])
def test_omitted_max_tokens_on_a_capped_server_is_served_within_the_cap(small_pool_server, path, body):
    """The client asked for no particular length: the default must fit the server's cap, not break it."""
    r = httpx.post(small_pool_server.url(path), json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 8
    over = httpx.post(small_pool_server.url(path), json={**body, "max_tokens": 9}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("body", [prompt(prompt=ids(125), max_tokens=8), prompt(prompt=ids(70), max_tokens=1),
                                  prompt(prompt=ids(125), max_tokens=8, n=2)],
                         ids=["over_context", "over_kv_pool", "over_context_n2"])
def test_request_refused_by_the_engine_leaves_it_idle(small_pool_server, body):
    """Refusals raised inside the engine (not by the server's own checks) leave nothing behind."""
    r = httpx.post(small_pool_server.url(C), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert_engine_sleeps(small_pool_server)
    assert small_pool_server.aengine.num_live == 0


# ------------------------------------------------------------------------------------------ raw sockets

RAW_CASES = {
    # name: (chunks, acceptable statuses, codes (None: not JSON, from the HTTP layer)).
    # A status of None: the server may also reset the connection without a response.
    "chunked_body_over_limit_without_content_length": (chunked_body_over_limit, (413,), ("request_too_large",)),
    "content_length_over_limit_without_body": (
        lambda: [request_head(C, f"Content-Length: {10 ** 11}\r\n")], (413,), ("request_too_large",)),
    "content_length_not_a_number": (
        lambda: [request_head(C, "Content-Length: lots\r\n") + b"{}"], (400, 413), None),
    "oversized_header": (
        lambda: [request_head(C, "X-Big: " + "a" * (256 << 10) + "\r\nContent-Length: 2\r\n") + b"{}"],
        (400, 431, None), None),
    "thousands_of_headers": (
        lambda: [request_head(C, "".join(f"X-H{i}: {'v' * 40}\r\n" for i in range(5000))
                              + "Content-Length: 2\r\n") + b"{}"], (400, 431, None), None),
    "invalid_utf8_over_raw_socket": (
        lambda: [request_head(C, "Content-Length: 14\r\n") + b'{"prompt":"\xff"}'], (400,), ("invalid_json",)),
}


@pytest.mark.parametrize("name", list(RAW_CASES))
def test_hostile_raw_socket(server, client, baseline, name):
    chunks, statuses, codes = RAW_CASES[name]
    start = time.monotonic()
    reply = raw_exchange(server.settings.port, chunks())
    assert time.monotonic() - start < 15
    if reply is None:
        assert None in statuses, "the server reset the connection without answering"
    else:
        assert reply.status in statuses, (reply.status, reply.body[:300])
        if codes is not None:
            assert_error_shape(reply, reply.status, codes)
        assert_no_echo(reply, None)
    assert_recovered(client, baseline)


def test_engine_sleeps_after_all_the_cases(server):
    """Runs after every case above: nothing they left behind keeps the engine thread busy."""
    assert_engine_sleeps(server)


# ------------------------------------------------------------------------------------------ security


def test_docker_image_runs_as_non_root():
    """The image's last USER (the one the server runs as) is neither root nor uid 0."""
    lines = (Path(__file__).resolve().parent.parent / "Dockerfile").read_text().splitlines()
    users = [ln.split()[1] for ln in lines if ln.strip().upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
