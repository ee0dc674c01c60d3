"""`kvserve serve`: start the engine-core process, then the front end(s), and take them down together.

  launcher (this process) ── spawns ──> kvserve::engine-core      (scheduler, KV cache, runner, GPU)
        │                                   ▲ AddRequest / AbortRequests (zmq PUSH -> PULL, msgpack)
        │                                   │ EngineOutputs per step (zmq PUSH -> PULL, one socket per front end)
        └─ N = 1: serves HTTP itself ───────┤
           N > 1: spawns kvserve::api-server-0..N-1, which share the listening socket bound here

The launcher holds the write end of a lifeline pipe: if it is killed, every child reads EOF and exits. If a
front-end process dies unexpectedly, the launcher stops the rest and exits 1. On SIGTERM every front end
drains, then the core is asked to stop; the launcher exits 0 with no child left.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import wait
from pathlib import Path

from engine.core.process import CoreAddresses, EngineCoreHandle, EngineCoreSpec, start_engine_core
from server.engine_client import CoreConnection
from server.frontend import FrontendSpec, frontend_process_main, serve, uvicorn_config

logger = logging.getLogger("kvserve.server")


def run_server(engine_config, settings) -> int:
    n = settings.num_api_servers
    addresses = CoreAddresses.new(n)
    metrics_dir = _multiprocess_metrics_dir() if n > 1 else None
    handle = start_engine_core(EngineCoreSpec(engine_config, addresses, settings.log_level))
    logger.info("kvserve: engine core pid %d; %d front end(s) on http://%s:%d; /ready is 200 once the model "
                "is loaded", handle.process.pid, n, settings.host, settings.port)
    try:
        peers_ready = mp.get_context("spawn").Array("b", n, lock=False) if n > 1 else None
        specs = [FrontendSpec(settings, CoreConnection(addresses, i, handle.core_alive, peers_ready),
                              engine_config.model, metrics_dir) for i in range(n)]
        return serve(specs[0]) if n == 1 else _supervise(specs, handle)
    finally:
        code = handle.shutdown(timeout=max(settings.shutdown_timeout, 10.0))
        logger.info("engine core exited with %s", code)
        shutil.rmtree(Path(addresses.inbox[len("ipc://"):]).parent, ignore_errors=True)
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _multiprocess_metrics_dir() -> str:
    """Set before any front end starts (they read it when they import prometheus_client)."""
    folder = tempfile.mkdtemp(prefix="kvserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    return folder


def _supervise(specs: list[FrontendSpec], handle: EngineCoreHandle) -> int:
    """N front-end processes on one socket; signals forwarded; any unexpected exit takes all down."""
    settings = specs[0].settings
    sock = uvicorn_config(None, settings).bind_socket()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=frontend_process_main, args=(spec, i, sock, handle.launcher_alive),
                         name=f"kvserve::api-server-{i}") for i, spec in enumerate(specs)]
    for p in procs:
        p.start()
    sock.close()
    return _wait_for_front_ends(procs)


def _wait_for_front_ends(procs: list) -> int:
    signals = []
    previous = {s: signal.signal(s, lambda sig, frame: signals.append(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = False
    try:
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
            while signals:
                signals.pop()
                _signal_all(procs, signal.SIGTERM)
            exited = [p for p in procs if not p.is_alive() and p.exitcode != 0]
            if exited and not failed:
                failed = True
                logger.error("front end %s exited with %s: stopping the others", exited[0].name, exited[0].exitcode)
                _signal_all(procs, signal.SIGTERM)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1 if failed else 0


def _signal_all(procs: list, sig: int) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, sig)
