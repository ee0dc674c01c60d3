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

from engine.config import usable_cores
from engine.core.process import CoreAddresses, EngineCoreHandle, EngineCoreSpec, start_engine_core
from server.engine_client import CoreConnection, CoreEndpoint
from server.frontend import FrontendSpec, frontend_process_main, serve, uvicorn_config

logger = logging.getLogger("kvserve.server")


def run_server(engine_config, settings) -> int:
    n = settings.num_api_servers
    metrics_dir = _multiprocess_metrics_dir() if n > 1 else None
    handles = start_engine_cores(engine_config, settings, n)
    logger.info("kvserve: engine core pid(s) %s; %d front end(s) on http://%s:%d; /ready is 200 once the model "
                "is loaded", [h.process.pid for h in handles], n, settings.host, settings.port)
    try:
        peers_ready = mp.get_context("spawn").Array("b", n, lock=False) if n > 1 else None
        cores = [CoreEndpoint(h.spec.addresses, h.core_alive) for h in handles]
        specs = [FrontendSpec(settings, CoreConnection(cores, i, peers_ready, settings.data_parallel_dispatch),
                              engine_config.model, metrics_dir) for i in range(n)]
        return serve(specs[0]) if n == 1 else _supervise(specs, handles[0])
    finally:
        _stop_engine_cores(handles, timeout=max(settings.shutdown_timeout, 10.0))
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def start_engine_cores(engine_config, settings, num_front_ends: int) -> list[EngineCoreHandle]:
    """`--data-parallel-size` cores: on CUDA one GPU each (CUDA_VISIBLE_DEVICES), on the CPU a share of the
    cores' threads each."""
    dp = settings.data_parallel_size
    handles = []
    for i in range(dp):
        env = {"CUDA_VISIBLE_DEVICES": str(i)} if dp > 1 and engine_config.device != "cpu" else {}
        threads = max(1, (usable_cores() - 1) // dp) if dp > 1 else None
        spec = EngineCoreSpec(engine_config, CoreAddresses.new(num_front_ends), settings.log_level, env=env,
                              cpu_threads=threads)
        handles.append(start_engine_core(spec))
    return handles


def _stop_engine_cores(handles: list[EngineCoreHandle], timeout: float) -> None:
    for handle in handles:
        code = handle.shutdown(timeout=timeout)
        logger.info("engine core %d exited with %s", handle.process.pid, code)
        shutil.rmtree(Path(handle.spec.addresses.inbox[len("ipc://"):]).parent, ignore_errors=True)


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
    """Until every front end has exited. A stop signal is passed on to them all; once one came, their exits (a
    front end still starting dies of the SIGTERM itself: -15) are the stop, not a failure. Otherwise a front end
    that exits non-zero stops the others, and the launcher exits 1."""
    signals = []
    previous = {s: signal.signal(s, lambda sig, frame: signals.append(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
    failed = stopping = False
    try:
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
            while signals:
                signals.pop()
                stopping = True
                _signal_all(procs, signal.SIGTERM)
            exited = [p for p in procs if not p.is_alive() and p.exitcode != 0]
            if exited and not failed and not stopping:
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
