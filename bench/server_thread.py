"""The real front end (the FastAPI app under uvicorn) in a thread of this process, over a real engine-core
process: what the tests and benchmarks/server_step_profile.py serve from. `kvserve serve --api-server-count 1`
runs the same parts, the front end in a process of its own.

    with ServerThread(EngineConfig(...), ServerSettings(port=...), engine_factory=...) as server:
        httpx.get(server.url("/v1/models"))

engine_factory(config) -> engine (picklable: it runs in the core) lets a caller wrap the engine.
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path


class ServerThread:
    def __init__(self, engine_config, settings, engine_factory=None, draining: bool = False,
                 ready_timeout_s: float = 120.0, start_method: str = "spawn") -> None:
        self.engine_config, self.settings = engine_config, settings
        self.engine_factory = engine_factory
        self.draining = draining  # frontend.DrainingServer (what `kvserve serve` runs) instead of uvicorn.Server
        self.ready_timeout_s = ready_timeout_s
        self.start_method = start_method  # the core's (engine.core.process.start_engine_core)
        self.base_url = f"http://127.0.0.1:{settings.port}"
        self.app = self.aengine = self.server = self.thread = self.core = None

    def __enter__(self) -> "ServerThread":
        import uvicorn

        from engine.core.process import CoreAddresses, EngineCoreSpec, start_engine_core
        from server.engine_client import CoreConnection, CoreEndpoint
        from server.frontend import DrainingServer, FrontendSpec, build_frontend, uvicorn_config

        addresses = CoreAddresses.new(1)
        self.core = start_engine_core(EngineCoreSpec(self.engine_config, addresses, "warning", self.engine_factory),
                                      self.start_method)
        try:
            spec = FrontendSpec(self.settings, CoreConnection([CoreEndpoint(addresses, self.core.core_alive)]),
                                self.engine_config.model)
            self.aengine, self.app = build_frontend(spec)
            config = uvicorn_config(self.app, self.settings)
            self.server = (DrainingServer(config, self.aengine, self.settings.shutdown_timeout) if self.draining
                           else uvicorn.Server(config))
            self.thread = threading.Thread(target=self.server.run, name="kvserve-uvicorn-thread", daemon=True)
            self.thread.start()
            self._wait_ready()
        except BaseException:
            self.core.shutdown(timeout=5)  # a front end that never came up must not leave its core behind
            raise
        return self

    def _wait_ready(self) -> None:
        """Until /ready answers 200; RuntimeError once the core process has exited or the time is up."""
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url("/ready"), timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if not self.core.process.is_alive():
                raise RuntimeError(f"the engine core exited with {self.core.process.exitcode} while loading")
            time.sleep(0.1)
        raise TimeoutError(f"{self.base_url} not ready after {self.ready_timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        code = self.core.shutdown(timeout=30)
        shutil.rmtree(Path(self.core.spec.addresses.inbox[len("ipc://"):]).parent, ignore_errors=True)
        assert not self.thread.is_alive(), "uvicorn did not stop"
        assert code is not None, "the engine core did not stop"

    @property
    def core_pid(self) -> int:
        return self.core.process.pid

    def url(self, path: str) -> str:
        return self.base_url + path
