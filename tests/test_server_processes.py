"""The processes of `kvserve serve`, killed and signalled for real: a launcher, one engine core
(`kvserve::engine-core`) and, with --api-server-count N > 1, N front ends (`kvserve::api-server-K`).

- the engine core SIGKILLed: requests in flight end with a 500-class error (an SSE error event when
  streaming) within a second, /health and /ready turn 503, new work gets 503 engine_dead, nothing hangs;
- the launcher SIGKILLed: every child (core, front ends) exits, nothing holds the GPU;
- one front end SIGKILLed: the launcher takes the rest down and exits 1;
- SIGTERM drains through every process and exits 0 with no child left; /metrics counts every front end;
- a front end loads its tokenizer while the core still loads the model (the core says where it is first).
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from server_utils import (Faults, ServerThread, faulty_engine, parse_metrics, start, start_server_process,
                          stop_process, wait_for)

LONG = {"prompt": "a long one", "max_tokens": 450, "ignore_eos": True, "temperature": 0}
SHORT = {"prompt": "a short one", "max_tokens": 4, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def serve(model_dir: str, api_servers: int):
    return start_server_process(["--model", model_dir, "--device", "cpu", "--num-kv-blocks", "128",
                                 "--api-server-count", str(api_servers), "--shutdown-timeout", "30",
                                 "--log-level", "warning"])


def reap(proc) -> None:
    """After a failed assertion: the server must not outlive its test."""
    if proc.poll() is None:
        stop_process(proc, sig=signal.SIGKILL)


def titled(proc, title: str) -> psutil.Process:
    """The child of `proc` whose process title is `title` (setproctitle rewrites its command line)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        if " ".join(child.cmdline()).strip() == title:
            return child
    raise AssertionError(f"no child titled {title!r}")


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The ones still alive after `timeout` seconds."""
    psutil.wait_procs(processes, timeout=timeout)
    return alive(processes)


def test_engine_core_killed_fails_in_flight_requests_within_a_second(model_dir):
    proc, base = serve(model_dir, 1)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        core = titled(proc, "kvserve::engine-core")
        stream, plain = start(base, {**LONG, "stream": True}), start(base, LONG)
        assert stream.first.wait(60)
        wait_for(lambda: core_counts(base) >= 2, timeout=30, what="both requests to be running")
        killed = time.monotonic()
        core.kill()
        stream.join(10), plain.join(10)
        took = time.monotonic() - killed
        health, ready = httpx.get(base + "/health", timeout=10), httpx.get(base + "/ready", timeout=10)
        late = httpx.post(base + "/v1/completions", json=SHORT, timeout=10)
        code, out = stop_process(proc, timeout=30)
    finally:
        reap(proc)
    assert took < 1.0, f"in-flight requests took {took:.2f} s to fail"
    assert stream.events[-1] == "[DONE]" and stream.events[-2]["error"]["type"] == "server_error"
    assert plain.response.status_code == 500 and plain.response.json()["error"]["code"] == "internal_error"
    assert health.status_code == 503 and ready.status_code == 503
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert code is not None and not wait_gone(children, 10), out[-3000:]


def core_counts(base: str) -> float:
    m = parse_metrics(httpx.get(base + "/metrics", timeout=10).text)
    return m["kvserve_requests_running"] + m["kvserve_requests_waiting"]


def test_launcher_killed_takes_every_child_down(model_dir):
    proc, base = serve(model_dir, 2)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        stream = start(base, {**LONG, "stream": True})
        assert stream.first.wait(60)
        proc.kill()
        left = wait_gone(children, 15)
    finally:
        reap(proc)
        for p in alive(children):
            p.kill()
    assert not left, [p.cmdline() for p in left]
    stream.join(10)
    assert not stream.is_alive() and stream.transport_error is not None  # the connection ended; nothing hangs


def test_a_front_end_killed_stops_the_server_with_exit_1(model_dir):
    proc, base = serve(model_dir, 2)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        titled(proc, "kvserve::api-server-1").kill()
        code, out = stop_process(proc, sig=None, timeout=30)
    finally:
        reap(proc)
    assert code == 1, out[-3000:]
    assert not wait_gone(children, 10)


def test_sigterm_drains_every_process_and_metrics_count_every_front_end(model_dir):
    proc, base = serve(model_dir, 2)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        titles = {" ".join(p.cmdline()).strip() for p in children}
        for _ in range(12):  # a new connection each: the kernel spreads them over both front ends
            assert httpx.post(base + "/v1/completions", json=SHORT, timeout=60).status_code == 200
        scrapes = [parse_metrics(httpx.get(base + "/metrics", timeout=10).text) for _ in range(6)]
        streams = [start(base, {**SHORT, "max_tokens": 40, "stream": True}) for _ in range(4)]
        for s in streams:
            assert s.first.wait(60)
        proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(60)
        code, out = stop_process(proc, sig=None, timeout=60)
    finally:
        reap(proc)
    assert {"kvserve::engine-core", "kvserve::api-server-0", "kvserve::api-server-1"} <= titles
    assert {m['kvserve_requests_finished_total{reason="length"}'] for m in scrapes} == {12.0}
    assert code == 0, out[-3000:]
    assert all(s.finish_reasons == ["length"] and s.events[-1] == "[DONE]" for s in streams)
    assert not wait_gone(children, 10)
    assert "Traceback" not in out


LONELY_LAUNCHER = """
import sys, time
from engine.config import EngineConfig
from engine.core.process import CoreAddresses, EngineCoreSpec, start_engine_core
handle = start_engine_core(EngineCoreSpec(EngineConfig(model=sys.argv[1], device="cpu"), CoreAddresses.new(1), "info"))
print(handle.process.pid, flush=True)
time.sleep(600)
"""


def test_a_core_whose_front_end_never_came_up_exits_with_its_launcher(model_dir):
    """The core loads, then waits for a front end to connect (to say Ready); if none ever does and the launcher
    dies, the core must not wait forever."""
    import subprocess
    import sys

    from server_utils import REPO

    launcher = subprocess.Popen([sys.executable, "-c", LONELY_LAUNCHER, model_dir], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    core = psutil.Process(int(launcher.stdout.readline()))
    # The engine's last words once built ("KV cache: ..."); then it waits to announce itself to no front end.
    assert any("KV cache:" in line for line in iter(launcher.stderr.readline, "")), "the core never loaded"
    time.sleep(0.5)
    launcher.kill()
    launcher.wait()
    launcher.stderr.close()  # a core still logging gets EPIPE, never a full pipe that holds it up
    assert not wait_gone([core], 15)


def test_the_front_end_loads_its_tokenizer_while_the_core_loads_the_model(model_dir):
    """The core's load is held: the front end has its tokenizer already, and is not ready; let go, it serves
    with that same tokenizer (loaded once)."""
    faults = Faults()
    faults.load_hold = 1
    server = ServerThread(model_dir, engine_factory=faulty_engine(faults))
    starter = threading.Thread(target=server.__enter__, daemon=True)
    starter.start()
    try:
        wait_for(lambda: server.aengine is not None and server.aengine._tokenizer_load is not None
                 and server.aengine._tokenizer_load[1].done(), timeout=60, what="the tokenizer, early")
        assert server.aengine.info is None and server.aengine.tokenizer is None  # the core is still loading
        assert httpx.get(server.url("/ready"), timeout=5).status_code == 503
        faults.load_hold = 0
        starter.join(timeout=120)
        assert not starter.is_alive()
        assert server.aengine.tokenizer is server.aengine._tokenizer_load[1].result()
        r = httpx.post(server.url("/v1/completions"), json={**SHORT, "model": model_dir}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        faults.load_hold = 0
        starter.join(timeout=120)
        if server.thread is not None:
            server.__exit__(None, None, None)


def test_a_forked_core_cannot_take_an_environment_to_set_before_its_imports():
    """The forkserver imported torch already: a spec whose environment must come first is refused, not dropped."""
    from engine.config import EngineConfig
    from engine.core.process import CoreAddresses, EngineCoreSpec, start_engine_core

    spec = EngineCoreSpec(EngineConfig(model="m", device="cpu"), CoreAddresses("ipc://x", []),
                          env={"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(ValueError, match="spawn it"):
        start_engine_core(spec, start_method="forkserver")
