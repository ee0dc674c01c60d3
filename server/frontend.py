"""One HTTP front-end process: an EngineClient, the FastAPI app over it, and uvicorn.

With --api-server-count 1 the launcher runs this in its own process; with N > 1 it spawns N processes titled
`kvserve::api-server-K`, each serving the listening socket the launcher bound (the kernel spreads new
connections over them, so each stream is served by one).

SIGTERM / SIGINT drain: new requests get 503 and /ready turns 503, requests in flight get --shutdown-timeout
seconds, the rest are aborted. A second signal aborts everything at once.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import sys
import threading
from dataclasses import dataclass

import uvicorn

from server.engine_client import CoreConnection, EngineClient
from server.http_guard import EdgeLimits, guarded_protocol

logger = logging.getLogger("kvserve.server")


@dataclass
class FrontendSpec:
    """What a front-end process needs besides its socket (pickled to it at spawn)."""
    settings: object  # ServerSettings
    connection: CoreConnection
    model: str | None  # the configured model (None: the embedded default)
    multiprocess_dir: str | None = None  # prometheus_client's multiprocess directory, with N > 1 front ends


def build_frontend(spec: FrontendSpec):
    """(client, app)."""
    from server.app import create_app

    client = EngineClient(spec.connection, spec.settings, spec.model, spec.multiprocess_dir)
    return client, create_app(client, spec.settings)


def settle_heap(app) -> int:
    """Once the model is loaded: the serving context is built and every object alive is frozen out of the
    collector's walk (engine/malloc.py); returns how many. A front end holds ~350k startup objects
    (transformers, the tokenizer, FastAPI's models): a full collection walked them all, ~170-250 ms with the
    event loop stopped, whenever the long-lived objects had grown by a quarter (about once per 4,000 requests
    on the CPU load of benchmarks/loop_stalls.py), holding every stream. vLLM's API server freezes its heap too.
    Python's young-generation threshold (700) stays: at 10,000 the front end's CPU per 1k streamed tokens
    (benchmarks/loop_stalls.py, this 2-core machine) moved within the runs' noise (32 streams: 48.1-53.9 ms
    against 50.1-53.6; 64: 41.1-44.1 against 44.0-50.4). Only for a front-end process (`serve`), never a
    test's in-process server."""
    from engine.malloc import freeze_startup_objects
    from server.app import serving_context

    serving_context(app)
    frozen = freeze_startup_objects()
    logger.info("front end %d: %d startup objects frozen (full collections skip them)", os.getpid(), frozen)
    return frozen


def uvicorn_config(app, settings) -> uvicorn.Config:
    """uvicorn with the HTTP edge of server/http_guard.py (connection cap, header / body / write timeouts,
    framing) and an access log that never shows a query string."""
    limits = EdgeLimits(settings.max_connections, settings.header_timeout, settings.body_timeout,
                        settings.write_timeout)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=settings.keep_alive_timeout,
                          http=guarded_protocol(limits), log_config=_log_config(), loop=settings.loop)


class RedactQuery(logging.Filter):
    """uvicorn's access-log record is (client, method, path?query, http version, status): the query string
    may hold a credential (`?api_key=...`), so it is replaced by `?<redacted>`."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0] + "?<redacted>", *args[3:])
        return True


def _log_config() -> dict:
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_query"] = {"()": RedactQuery}
    config["handlers"]["access"]["filters"] = ["redact_query"]
    return config


def serve(spec: FrontendSpec, sockets=None) -> int:
    """Run one front end until it is stopped. 1 if the model failed to load, else 0."""
    client, app = build_frontend(spec)
    server = DrainingServer(uvicorn_config(app, spec.settings), client, spec.settings.shutdown_timeout)
    client.on_fatal = lambda exc: server.request_exit()
    client.on_loaded = lambda: settle_heap(app)
    server.run(sockets=sockets)
    if client.load_error is not None:
        print(f"kvserve: loading the model failed: {client.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0


def frontend_process_main(spec: FrontendSpec, index: int, sock, launcher_alive) -> None:
    """Entry point of front-end process `index` (N > 1): its own process group (the launcher forwards signals,
    so that Ctrl-C does not reach it twice), and an exit when the launcher is gone."""
    os.setpgrp()
    try:
        import setproctitle

        setproctitle.setproctitle(f"kvserve::api-server-{index}")
    except ImportError:
        pass
    logging.basicConfig(level=spec.settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    watch_lifeline(launcher_alive, "the launcher")
    raise SystemExit(serve(spec, sockets=[sock]))


def watch_lifeline(conn, whose: str) -> None:
    """A daemon thread that ends this process when `conn` (a pipe's read end, never written) reads EOF."""
    def wait() -> None:
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            pass
        logger.error("%s is gone: exiting", whose)
        os._exit(1)

    threading.Thread(target=wait, name="kvserve-lifeline", daemon=True).start()


# After a drained front end stops accepting: time for a connection it accepted just before to send its request
# (a loopback client sends it within a millisecond of connecting) and get its answer.
ACCEPTED_GRACE_S = 0.5


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first SIGTERM / SIGINT drains instead of closing the listening socket at once."""

    def __init__(self, config: uvicorn.Config, aengine, shutdown_timeout: float):
        super().__init__(config)
        self.aengine = aengine
        self.shutdown_timeout = shutdown_timeout
        self._drain_started = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame):
        # Not recorded in _captured_signals: uvicorn would re-raise it at exit, and we would not exit 0.
        if self._loop is None:
            self.should_exit = True
        elif self._drain_started:
            logger.warning("second signal: aborting every request now")
            self._loop.call_soon_threadsafe(self.aengine.abort_all)
            self.should_exit = True
        else:
            self._drain_started = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    def _drop_stalled(self) -> None:
        """Responses blocked on clients that read nothing would hold the exit up: drop their connections."""
        for conn in list(self.server_state.connections):
            if getattr(conn, "stalled", False):
                conn.abort()

    def request_exit(self) -> None:
        self.should_exit = True

    async def _drain(self) -> None:
        logger.info("draining: refusing new requests; %d in flight get %.0f s", self.aengine.num_live,
                    self.shutdown_timeout)
        self.aengine.begin_drain()
        if not await self.aengine.wait_idle(self.shutdown_timeout):
            logger.warning("shutdown timeout: aborting %d requests", self.aengine.num_live)
            self.aengine.abort_all()
            if not await self.aengine.wait_idle(1.0):
                self._drop_stalled()
                await self.aengine.wait_idle(10.0)
        await self._stop_accepting()
        self.should_exit = True

    async def _stop_accepting(self) -> None:
        """Close this process's listening sockets, then answer what was accepted just before. uvicorn's own exit
        closes a connection that has not sent its request yet: with several front ends on one socket, a front end
        with nothing in flight finished its drain at once, and a client's request that it had just accepted was
        reset (seen in CI: a GET /ready during a drain, `Connection reset by peer`). The other front ends go
        on accepting (they hold the socket too) and answer 503."""
        for server in self.servers:
            server.close()
        await asyncio.sleep(ACCEPTED_GRACE_S)
