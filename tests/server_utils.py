"""Helpers to run the real server in tests: uvicorn on a loopback port (in a thread over an engine-core process,
or `kvserve serve` as a subprocess)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.server_thread import ServerThread as BaseServerThread

REPO = Path(__file__).resolve().parent.parent


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as module `name` (the folder is scripts, not a package); registered in
    sys.modules first, where its dataclasses look their module up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url + "/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not ready after {timeout} s")


class Faults:
    """Knobs the tests turn, read by the engine in the engine-core process (shared memory, so a test sets
    `faults.step_delay = 0.5` here and the core's next step sleeps)."""

    KNOBS = {"step_delay": "d", "forward_raises": "i", "step_raises": "i", "steps": "i", "leak_blocks": "i",
             "load_hold": "i"}

    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        values = {name: ctx.Value(kind, 0, lock=False) for name, kind in self.KNOBS.items()}
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name):
        return self._values[name].value

    def __setattr__(self, name, value):
        self._values[name].value = value

    def __getstate__(self):
        return self._values

    def __setstate__(self, values):
        object.__setattr__(self, "_values", values)


class FaultyEngine:
    """engine_factory for the engine core: an LLMEngine whose steps and forward passes obey `faults`.
    leak_blocks = k takes k KV blocks from the pool before the next step and holds them (a leak the idle
    invariant must catch); leak_blocks = 0 gives them back. load_hold = 1 holds the model's load until 0."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def __call__(self, config):
        from engine.engine import LLMEngine

        deadline = time.monotonic() + 120
        while self.faults.load_hold and time.monotonic() < deadline:  # the test holds the load here
            time.sleep(0.05)
        engine = LLMEngine(config)
        step, forward, faults, leaked = engine.step, engine.runner.model.forward, self.faults, []

        def slow_step():
            faults.steps += 1
            if not engine.has_unfinished_requests():
                return step()  # the core's idle check: faults are for steps that run requests
            _leak(engine.scheduler.pool, faults.leak_blocks, leaked)
            if faults.step_delay:
                time.sleep(faults.step_delay)
            if faults.step_raises > 0:
                faults.step_raises -= 1
                raise RuntimeError("injected engine-step fault")
            return step()

        def bad_forward(*args, **kwargs):
            if faults.forward_raises > 0:
                faults.forward_raises -= 1
                raise RuntimeError("injected model fault")
            return forward(*args, **kwargs)

        engine.step = slow_step
        engine.runner.model.forward = bad_forward
        return engine


def _leak(pool, wanted: int, leaked: list) -> None:
    if wanted > len(leaked):
        leaked += pool.allocate(wanted - len(leaked))
    elif wanted == 0 and leaked:
        pool.free(leaked)
        leaked.clear()


def faulty_engine(faults: Faults) -> FaultyEngine:
    return FaultyEngine(faults)


class ServerThread(BaseServerThread):
    """bench.server_thread.ServerThread with the tests' defaults: `model_dir` on the CPU, 128 KV blocks, 64
    sequences, a free port; options are EngineConfig or ServerSettings fields."""

    def __init__(self, model_dir, engine_factory=None, draining: bool = False, **options):
        from engine.config import EngineConfig
        from server.settings import ServerSettings

        engine_fields = set(EngineConfig.field_names())
        engine_opts = dict(model=str(model_dir), device="cpu", num_kv_blocks=128, max_num_seqs=64)
        engine_opts.update({k: v for k, v in options.items() if k in engine_fields})
        server_opts = {k: v for k, v in options.items() if k not in engine_fields}
        super().__init__(EngineConfig(**engine_opts), ServerSettings(port=free_port(), log_level="warning",
                                                                     **server_opts), engine_factory, draining,
                         start_method="forkserver")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url("/metrics"), timeout=10).text)

    def wait_blocks_free(self, timeout: float = 20.0) -> float:
        """Waits until the engine is idle (nothing running or waiting) and returns kvserve_kv_blocks_used then
        (the last value seen on a timeout): the number of blocks an idle server leaked."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = m["kvserve_requests_running"] + m["kvserve_requests_waiting"] + m["kvserve_kv_blocks_used"]
            if busy == 0 or time.monotonic() > deadline:
                return m["kvserve_kv_blocks_used"]
            time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{k="v",...}': value}, through prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response: dicts, and the string '[DONE]'."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def start_server_process(args: list[str], env: dict | None = None, port: int | None = None,
                         prefix: list[str] | None = None, wait: bool = True) -> tuple[subprocess.Popen, str]:
    """`python -m server serve ARGS --port PORT` as a subprocess (output to a temporary file, so a chatty
    server never blocks on a full pipe); returns it once /ready is 200 (at once with wait=False). `prefix`
    runs it under a wrapper (`prlimit --nofile=256`)."""
    port = port or free_port()
    cmd = [*(prefix or []), sys.executable, "-m", "server", "serve", "--port", str(port), *args]
    # The repository first, then what the caller's path held (a GPU host's wheels live in a --target folder).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    base_url = f"http://127.0.0.1:{port}"
    if not wait:
        return proc, base_url
    try:
        wait_ready(base_url, proc=proc)
    except Exception:
        _, out = stop_process(proc)
        raise RuntimeError(f"server did not start:\n{out[-3000:]}") from None
    return proc, base_url


def stop_process(proc: subprocess.Popen, sig: int | None = signal.SIGTERM, timeout: float = 60.0
                 ) -> tuple[int, str]:
    """Signal (unless sig is None), wait, and return (exit code, everything the server printed)."""
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    return proc.returncode, out


# ------------------------------------------------------------------------------------------ requests

def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


class Call(threading.Thread):
    """One request in a thread: a streaming one collects its `data:` payloads, a plain one its response."""

    def __init__(self, base_url: str, body: dict):
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, body
        self.events: list = []
        self.first = threading.Event()
        self.response: httpx.Response | None = None
        self.transport_error: httpx.TransportError | None = None  # the connection ended mid-response

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base_url, timeout=120) as http:
                if not self.body.get("stream"):
                    self.response = http.post("/v1/completions", json=self.body)
                    return
                with http.stream("POST", "/v1/completions", json=self.body) as r:
                    self.response = r
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                            self.first.set()
        except httpx.TransportError as exc:
            self.transport_error = exc
        finally:
            self.first.set()

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")]


def start(base_url: str, body: dict) -> Call:
    call = Call(base_url, body)
    call.start()
    return call
