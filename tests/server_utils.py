"""Helpers to run the real server in tests: uvicorn on a loopback port, in a thread or a subprocess."""
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

REPO = Path(__file__).resolve().parent.parent


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
    """Knobs the tests turn; read by the engine thread."""

    def __init__(self):
        self.step_delay = 0.0  # seconds each engine step sleeps first
        self.forward_raises = 0  # the next N model forward passes raise
        self.step_raises = 0  # the next N engine steps raise (outside the engine's own error handling)
        self.steps = 0


def faulty_engine(faults: Faults):
    from engine.engine import LLMEngine

    def make(config):
        engine = LLMEngine(config)
        step, forward = engine.step, engine.runner.model.forward

        def slow_step():
            faults.steps += 1
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

    return make


class ServerThread:
    """The real app under uvicorn in a background thread of this process.

    engine_factory(config) -> engine lets a test wrap the engine (fault injection); default LLMEngine.
    """

    def __init__(self, model_dir, engine_factory=None, draining: bool = False, **options):
        from engine.config import EngineConfig
        from server.settings import ServerSettings

        engine_fields = set(EngineConfig.field_names())
        engine_opts = dict(model=str(model_dir), device="cpu", num_kv_blocks=128, max_num_seqs=64)
        engine_opts.update({k: v for k, v in options.items() if k in engine_fields})
        self.engine_config = EngineConfig(**engine_opts)
        server_opts = {k: v for k, v in options.items() if k not in engine_fields}
        self.settings = ServerSettings(port=free_port(), log_level="warning", **server_opts)
        self.engine_factory = engine_factory
        self.draining = draining  # cli.DrainingServer (what `kvserve serve` runs) instead of uvicorn.Server
        self.base_url = f"http://127.0.0.1:{self.settings.port}"
        self.app = self.aengine = self.server = self.thread = None

    def __enter__(self) -> "ServerThread":
        import uvicorn

        from engine.engine import LLMEngine
        from server.app import create_app
        from server.async_engine import AsyncEngine

        import torch

        self._threads = torch.get_num_threads()  # the server lowers it on the CPU; later tests get it back
        factory = self.engine_factory or LLMEngine
        self.aengine = AsyncEngine(lambda: factory(self.engine_config), self.settings)
        self.app = create_app(self.aengine, self.settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.settings.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        if self.draining:
            from server.cli import DrainingServer

            self.server = DrainingServer(config, self.aengine, self.settings.shutdown_timeout)
        else:
            self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        wait_ready(self.base_url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "uvicorn did not stop"
        import torch

        torch.set_num_threads(self._threads)

    def url(self, path: str) -> str:
        return self.base_url + path

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


def start_server_process(args: list[str], env: dict | None = None, port: int | None = None
                         ) -> tuple[subprocess.Popen, str]:
    """`python -m server serve ARGS --port PORT` as a subprocess (output to a temporary file, so a chatty
    server never blocks on a full pipe); returns it once /ready is 200."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    base_url = f"http://127.0.0.1:{port}"
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
