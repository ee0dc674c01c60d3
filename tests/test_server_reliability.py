"""Overload, deadlines, model faults, a stuck or dead engine loop: against the real server, with faults injected
into the real engine (a slow step, a forward pass that raises, a step that raises)."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server_utils import Faults, ServerThread, faulty_engine, sse_events


@pytest.fixture(scope="module")
def faults():
    return Faults()


@pytest.fixture(scope="module")
def server(tiny_model_dir, faults):
    with ServerThread(tiny_model_dir("llama"), engine_factory=faulty_engine(faults), served_model_name="tiny",
                      max_waiting_requests=3, max_waiting_tokens=4096, retry_after=2) as s:
        yield s


@pytest.fixture(autouse=True)
def clean(server, faults):
    yield
    faults.step_delay, faults.forward_raises, faults.step_raises = 0.0, 0, 0
    assert server.wait_blocks_free() == 0
    assert server.metrics()["kvserve_idle_invariant_violations_total"] == 0


def body(**extra) -> dict:
    return {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, **extra}


def post(server, **extra) -> httpx.Response:
    return httpx.post(server.url("/v1/completions"), json=body(**extra), timeout=60)


def test_engine_sleeps_when_idle(server, faults):
    post(server)
    time.sleep(0.3)
    before = faults.steps
    time.sleep(1.0)
    assert faults.steps == before  # no step calls while there is no work


def test_overload_gives_429_with_retry_after(server, faults):
    faults.step_delay = 0.5  # first tokens arrive slowly, so waiting requests pile up

    async def flood():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(server.url("/v1/completions"), json=body(max_tokens=2))
                                          for _ in range(10)))

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 3 and statuses.count(429) >= 1 and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["code"] == "overloaded"
    faults.step_delay = 0.0
    assert post(server).status_code == 200


def test_overload_by_queued_prompt_tokens(server, faults):
    faults.step_delay = 1.0
    long_prompt = [7] * 300

    async def flood():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(server.url("/v1/completions"),
                                                      json=body(prompt=long_prompt, max_tokens=1))
                                          for _ in range(3)))

    server.aengine.waiting.max_tokens = 500  # one 300-token prompt waits; a second would pass 500
    try:
        statuses = sorted(r.status_code for r in asyncio.run(flood()))
    finally:
        server.aengine.waiting.max_tokens = 4096
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses


def test_ready_reports_overload(server, faults):
    faults.step_delay = 1.0
    threads = [threading.Thread(target=post, args=(server,)) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    seen = None
    while time.monotonic() < deadline:
        r = httpx.get(server.url("/ready"))
        if r.status_code == 503:
            seen = r.json()
            break
        time.sleep(0.02)
    faults.step_delay = 0.0
    for t in threads:
        t.join()
    assert seen is not None and seen["detail"] == "overloaded"
    assert httpx.get(server.url("/health")).status_code == 200


def test_total_deadline_non_streaming(server, faults):
    faults.step_delay = 0.05
    t0 = time.monotonic()
    resp = post(server, max_tokens=400, ignore_eos=True, timeout=0.5)
    assert resp.status_code == 408 and resp.json()["error"]["code"] == "timeout"
    assert "total time" in resp.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert server.metrics()['kvserve_request_timeouts_total{deadline="total"}'] >= 1


def test_total_deadline_streaming(server, faults):
    faults.step_delay = 0.05
    with httpx.stream("POST", server.url("/v1/completions"), timeout=60,
                      json=body(max_tokens=400, ignore_eos=True, stream=True, timeout=2.0)) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "timeout"
    assert any("choices" in e for e in events[:-2])  # tokens flowed before the deadline


def test_queue_timeout(server, faults):
    faults.step_delay = 1.5  # the first step (prefill) alone outlasts the queue limit
    server.settings.queue_timeout = 0.5
    try:
        resp = post(server)
    finally:
        server.settings.queue_timeout = 300.0
    assert resp.status_code == 408 and "queue" in resp.json()["error"]["message"]
    assert server.metrics()['kvserve_request_timeouts_total{deadline="queue"}'] >= 1


def test_model_fault_fails_only_that_step(server, faults):
    faults.forward_raises = 1
    resp = post(server)
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert server.metrics()['kvserve_requests_finished_total{reason="error"}'] >= 1
    assert post(server).status_code == 200


def test_model_fault_mid_stream_is_an_sse_error(server, faults):
    faults.step_delay = 0.05
    with httpx.stream("POST", server.url("/v1/completions"), timeout=60,
                      json=body(max_tokens=50, ignore_eos=True, stream=True)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first
        faults.forward_raises = 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"internal_error"' in rest[-2]


def test_engine_step_exception_fails_requests_and_recovers(server, faults):
    faults.step_raises = 1
    resp = post(server)
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
    assert post(server).status_code == 200
    assert httpx.get(server.url("/health")).status_code == 200


def test_watchdog_reports_a_stuck_step(server, faults):
    server.settings.watchdog_timeout = 0.3
    faults.step_delay = 2.0
    try:
        worker = threading.Thread(target=post, args=(server,))
        worker.start()
        time.sleep(1.0)
        stuck = httpx.get(server.url("/health"))
        not_ready = httpx.get(server.url("/ready"))
        faults.step_delay = 0.0
        worker.join()
    finally:
        server.settings.watchdog_timeout = 60.0
    assert stuck.status_code == 503 and "step" in stuck.json()["detail"]
    assert not_ready.status_code == 503
    assert httpx.get(server.url("/health")).status_code == 200


def test_dead_engine_loop_is_unhealthy(tiny_model_dir):
    faults = Faults()
    with ServerThread(tiny_model_dir("llama"), engine_factory=faulty_engine(faults)) as s:
        faults.step_raises = 100  # every step fails: the loop gives up after a few
        assert post(s).status_code == 500
        deadline = time.monotonic() + 10
        while httpx.get(s.url("/health")).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(s.url("/health"))
        assert health.status_code == 503 and "died" in health.json()["detail"]
        assert httpx.get(s.url("/ready")).status_code == 503
        refused = post(s)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
