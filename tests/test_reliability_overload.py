"""Overload and deadlines: a bounded waiting queue (by completions and by prompt tokens) answers 429 with
Retry-After and code `overloaded` before any stream starts; queue-time and total-time limits (server
defaults and the per-request `timeout`) end requests cleanly (408 `timeout`, or an SSE error event then
[DONE]) and free their blocks.

The engine is throttled (every step sleeps a little) so that a long request really is still running
while the test looks at the queue, however fast the machine.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time

import httpx
import pytest

from engine.engine import LLMEngine
from server_utils import ServerThread, parse_metrics

STEP_SLEEP = 0.03
MAX_WAITING_REQUESTS = 3
MAX_WAITING_TOKENS = 200
RETRY_AFTER = 7
QUEUE_TIMEOUT = 1.0
REQUEST_TIMEOUT = 3.0
LONG = {"max_tokens": 340, "ignore_eos": True, "temperature": 0}  # 340 steps: 10 s or more, throttled


class ThrottledEngine(LLMEngine):
    def step(self):
        time.sleep(STEP_SLEEP)
        return super().step()


@pytest.fixture(scope="module")
def queue_server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), engine_factory=ThrottledEngine, max_model_len=512, max_num_seqs=2,
                      max_waiting_requests=MAX_WAITING_REQUESTS, max_waiting_tokens=MAX_WAITING_TOKENS,
                      retry_after=RETRY_AFTER) as s:
        yield s


@pytest.fixture(scope="module")
def deadline_server(tiny_model_dir):
    with ServerThread(tiny_model_dir("llama"), engine_factory=ThrottledEngine, max_model_len=512, max_num_seqs=1,
                      queue_timeout=QUEUE_TIMEOUT, request_timeout=REQUEST_TIMEOUT) as s:
        yield s


# ------------------------------------------------------------------------------------------ helpers


def metrics(http: httpx.Client) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text)


def wait_idle(server: ServerThread, http: httpx.Client, timeout: float = 30, settle: float = 0.3
              ) -> dict[str, float]:
    """The metrics once nothing is live, running, waiting or held for `settle` seconds in a row (the
    counters of a step are updated just after its gauges)."""
    end = time.monotonic() + timeout
    quiet_since = None
    while True:
        m = metrics(http)
        idle = m["kvserve_requests_running"] + m["kvserve_requests_waiting"] + m["kvserve_kv_blocks_used"] == 0
        now = time.monotonic()
        quiet_since = (quiet_since or now) if idle and server.aengine.num_live == 0 else None
        if (quiet_since is not None and now - quiet_since >= settle) or now > end:
            return metrics(http)
        time.sleep(0.05)


class OpenStream:
    """A streaming response read a little at a time. (Leaving a `for` over iter_lines() would close
    the connection, which is a client hanging up.)"""

    def __init__(self, response: httpx.Response):
        self.response = response
        self._lines = response.iter_lines()

    def next_event(self) -> dict:
        for line in self._lines:
            if line.startswith("data: "):
                return json.loads(line[6:])
        raise AssertionError("the stream ended without an event")


def open_stream(stack: contextlib.ExitStack, http: httpx.Client, body: dict) -> OpenStream:
    """A streaming request held open; returns once the response headers arrived (the request was admitted)."""
    r = stack.enter_context(http.stream("POST", "/v1/completions", json={**body, "stream": True}))
    assert r.status_code == 200, r.read()
    return OpenStream(r)


def first_token(stream: OpenStream) -> None:
    """Reads until the request produced a token (its first event may hold back text, but it has one)."""
    event = stream.next_event()
    assert "error" not in event and event["choices"][0]["finish_reason"] is None, event


def events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def assert_overloaded(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == str(RETRY_AFTER)
    assert r.headers["content-type"].startswith("application/json")  # refused before any stream started
    assert r.json()["error"]["code"] == "overloaded"


def wait_metric(http: httpx.Client, name: str, value: float, timeout: float = 10) -> float:
    """The engine's gauges are snapshots taken after each step: poll until `name` reads `value`."""
    end = time.monotonic() + timeout
    while (got := metrics(http)[name]) != value and time.monotonic() < end:
        time.sleep(0.02)
    return got


def tokens(n: int) -> list[int]:
    return [100 + i for i in range(n)]


@contextlib.contextmanager
def busy_server(http: httpx.Client):
    """Both batch slots taken by long requests that have their first token (so they no longer wait)."""
    with contextlib.ExitStack() as stack:
        blockers = [open_stream(stack, http, {"prompt": f"blocker {i}", **LONG}) for i in range(2)]
        for b in blockers:
            first_token(b)
        yield stack


# ------------------------------------------------------------------------------------------ overload


def test_waiting_queue_bounded_by_completions(queue_server):
    with httpx.Client(base_url=queue_server.base_url, timeout=30) as http:
        with busy_server(http) as stack:
            for i in range(MAX_WAITING_REQUESTS):  # fill the waiting queue exactly
                open_stream(stack, http, {"prompt": f"waiting {i}", **LONG})
            assert wait_metric(http, "kvserve_requests_waiting", MAX_WAITING_REQUESTS) == MAX_WAITING_REQUESTS
            assert_overloaded(http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2}))
            with http.stream("POST", "/v1/completions", json={"prompt": "one more", "stream": True}) as r:
                r.read()
                assert_overloaded(r)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert_overloaded(http.post("/v1/chat/completions", json=chat))
            ready = http.get("/ready")
            assert ready.status_code == 503 and "overloaded" in ready.json()["detail"]
            assert http.get("/health").status_code == 200  # overloaded is not unhealthy
        assert wait_idle(queue_server, http)["kvserve_kv_blocks_used"] == 0
        assert http.post("/v1/completions", json={"prompt": "after", "max_tokens": 2}).status_code == 200
        assert http.get("/ready").status_code == 200


def test_waiting_queue_bounded_by_prompt_tokens(queue_server):
    with httpx.Client(base_url=queue_server.base_url, timeout=30) as http:
        with busy_server(http) as stack:
            open_stream(stack, http, {"prompt": tokens(150), **LONG})  # 150 of the 200 queued tokens
            # Two completions waiting would be within the request bound; 150 + 60 tokens are not.
            assert_overloaded(http.post("/v1/completions", json={"prompt": tokens(60), "max_tokens": 2}))
            open_stream(stack, http, {"prompt": tokens(40), **LONG})  # 190: still fits
            assert wait_metric(http, "kvserve_requests_waiting", 2) == 2
            assert_overloaded(http.post("/v1/completions", json={"prompt": tokens(11), "max_tokens": 2}))
            # n counts as n completions: 2 waiting + 2 > 3.
            assert_overloaded(http.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2}))
        assert wait_idle(queue_server, http)["kvserve_kv_blocks_used"] == 0


def test_burst_against_a_full_queue_is_refused_quickly(queue_server):
    """A hundred requests at a full server: all 429, none hangs, nothing is queued for them."""
    def one(i: int) -> int:
        with httpx.Client(base_url=queue_server.base_url, timeout=30) as c:
            return c.post("/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 2,
                                                   "stream": i % 2 == 0}).status_code

    with httpx.Client(base_url=queue_server.base_url, timeout=30) as http:
        with busy_server(http) as stack:
            for i in range(MAX_WAITING_REQUESTS):
                open_stream(stack, http, {"prompt": f"waiting {i}", **LONG})
            wait_metric(http, "kvserve_requests_waiting", MAX_WAITING_REQUESTS)
            before = metrics(http)
            start = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(one, range(100)))
            assert statuses == [429] * 100
            assert time.monotonic() - start < 30
            after = metrics(http)
            assert after["kvserve_requests_waiting"] == MAX_WAITING_REQUESTS
            assert after["kvserve_prompt_tokens_total"] == before["kvserve_prompt_tokens_total"]
            rejected = 'kvserve_requests_rejected_total{code="overloaded"}'
            assert after[rejected] - before[rejected] == 100
        assert wait_idle(queue_server, http)["kvserve_kv_blocks_used"] == 0


# ------------------------------------------------------------------------------------------ deadlines


def assert_timeout_error(error: dict) -> None:
    assert error["code"] == "timeout", error
    assert error["type"] and error["message"]


def finished_abort(m: dict[str, float]) -> float:
    return m['kvserve_requests_finished_total{reason="abort"}']


def test_total_time_server_default_non_streaming(deadline_server):
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        before = metrics(http)
        start = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "tell me everything", **LONG})
        elapsed = time.monotonic() - start
        assert r.status_code == 408, r.text
        assert_timeout_error(r.json()["error"])
        assert REQUEST_TIMEOUT * 0.9 <= elapsed < REQUEST_TIMEOUT + 10
        after = wait_idle(deadline_server, http)
        assert after["kvserve_kv_blocks_used"] == 0
        assert finished_abort(after) == finished_abort(before) + 1


def test_total_time_streaming_ends_with_error_event_then_done(deadline_server):
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "stream it all", "stream": True, **LONG}) as r:
            assert r.status_code == 200
            got = events(r)
        assert got[-1] == "[DONE]"
        assert "error" in got[-2], got[-2]
        assert_timeout_error(got[-2]["error"])
        assert any(e.get("choices") for e in got[:-2] if isinstance(e, dict))  # tokens came before the deadline
        assert all(c["finish_reason"] is None for e in got[:-2] for c in e["choices"])
        assert wait_idle(deadline_server, http)["kvserve_kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_per_request_timeout_shorter_than_default(deadline_server, stream):
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        start = time.monotonic()
        body = {"prompt": "quick", "timeout": 0.5, "stream": stream, **LONG}
        r = http.post("/v1/completions", json=body)
        elapsed = time.monotonic() - start
        if stream:
            assert r.status_code == 200
            lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            assert_timeout_error(json.loads(lines[-2])["error"])
        else:
            assert r.status_code == 408
            assert_timeout_error(r.json()["error"])
        assert elapsed < REQUEST_TIMEOUT * 0.9  # the request's own 0.5 s applied, not the server's 3 s
        assert wait_idle(deadline_server, http)["kvserve_kv_blocks_used"] == 0


def test_per_request_timeout_cannot_exceed_server_limit(deadline_server):
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        start = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": "slow", "timeout": 600, **LONG})
        assert r.status_code == 408
        assert time.monotonic() - start < REQUEST_TIMEOUT + 10
        assert wait_idle(deadline_server, http)["kvserve_kv_blocks_used"] == 0


def test_a_stream_past_its_first_token_outlives_the_queue_limit(deadline_server):
    """The queue limit's alarm still rings after the first token came; the stream goes on to its total deadline."""
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        start = time.monotonic()
        with http.stream("POST", "/v1/completions", json={"prompt": "keep going", "stream": True, **LONG}) as r:
            got = events(r)
        elapsed = time.monotonic() - start
        assert_timeout_error(got[-2]["error"])
        assert "total time" in got[-2]["error"]["message"]
        assert REQUEST_TIMEOUT * 0.9 <= elapsed < REQUEST_TIMEOUT + 10
        assert sum(bool(e.get("choices")) for e in got[:-2] if isinstance(e, dict)) > 1  # it streamed meanwhile
        assert wait_idle(deadline_server, http)["kvserve_kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_queue_time_limit(deadline_server, stream):
    """max_num_seqs=1: behind a long request, a second one waits; past queue_timeout it ends as a timeout."""
    with httpx.Client(base_url=deadline_server.base_url, timeout=60) as http:
        with contextlib.ExitStack() as stack:
            blocker = open_stream(stack, http, {"prompt": "I was here first", **LONG})
            first_token(blocker)
            start = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": "behind", "max_tokens": 2, "stream": stream})
            elapsed = time.monotonic() - start
            if stream:
                lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                assert lines[-1] == "[DONE]" and len(lines) == 2, lines  # no token at all, the error, [DONE]
                error = json.loads(lines[-2])["error"]
            else:
                assert r.status_code == 408
                error = r.json()["error"]
            assert_timeout_error(error)
            assert "queue" in error["message"]
            assert QUEUE_TIMEOUT * 0.9 <= elapsed < REQUEST_TIMEOUT  # the queue limit, before the blocker's end
        assert wait_idle(deadline_server, http)["kvserve_kv_blocks_used"] == 0
