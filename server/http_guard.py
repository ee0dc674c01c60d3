"""The HTTP/1.1 edge of one front-end process: uvicorn's httptools protocol, plus what uvicorn does not do.

uvicorn (0.55) has a keep-alive timeout and nothing else: no cap on open connections (a process at its
open-file limit fails every accept and logs a traceback each time), no deadline for a request's headers or
body (a slowloris connection is held forever), no write timeout (a response whose client stopped reading
waits in `drain()` forever), and it serves a request that carries both Content-Length and
Transfer-Encoding: chunked and keeps the connection open (request smuggling, RFC 9112 section 6.1).
GuardedProtocol adds each of these, per connection, with timers on the event loop:

- connections beyond `max_connections` get a 503 and are closed at once (counted, one warning a minute);
- the headers of a request must arrive within `header_timeout` of the connection opening, or of the first
  byte of a later request on a kept-alive connection (then 408 and close); its body within `body_timeout` of
  its headers (then the connection closes: the handler sees a disconnect). Between requests, uvicorn's
  keep-alive timeout closes an idle connection;
- a connection whose writes stay blocked (the client reads nothing) for `write_timeout` is aborted (RST: a
  close would wait for a flush that never comes), which ends its response and aborts its request;
- Content-Length with Transfer-Encoding is refused with 400 and the connection closed.

Each request's scope carries `kvserve.abort` (in scope["extensions"]): what a response with a deadline calls
to drop its connection.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from dataclasses import dataclass

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("kvserve.server")

FD_RESERVE = 64  # file descriptors kept free beyond those open at start (logs, model files, zmq, pipes)
WARN_EVERY = 60.0  # seconds between two "connection refused" warnings


@dataclass(frozen=True)
class EdgeLimits:
    max_connections: int
    header_timeout: float
    body_timeout: float
    write_timeout: float


def raise_file_limit() -> int:
    """Lift this process's soft open-file limit to its hard limit (as vLLM does); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


def connection_cap(requested: int) -> int:
    """The requested cap, lowered to fit under the open-file limit (with the fds already open and a reserve)."""
    room = raise_file_limit() - open_fds() - FD_RESERVE
    cap = max(1, min(requested, room))
    if cap < requested:
        logger.warning("max_connections lowered from %d to %d: the open-file limit leaves no more", requested, cap)
    return cap


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "param": None, "code": code}})
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


BUSY = _raw_response(503, "Service Unavailable", "too many open connections; retry later", "too_many_connections")
HEADER_TIMEOUT = _raw_response(408, "Request Timeout", "the request headers did not arrive in time", "timeout")


async def _refuse_framing(scope, receive, send) -> None:
    body = orjson.dumps({"error": {"message": "a request may not carry both Content-Length and Transfer-Encoding",
                                   "type": "invalid_request_error", "param": None, "code": "invalid_framing"}})
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedProtocol(HttpToolsProtocol):
    limits: EdgeLimits  # set by guarded_protocol()
    refused = {"count": 0, "warned": 0.0}  # replaced per subclass

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # ---- connections ----------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._note_refused()
            transport.write(BUSY)
            transport.close()
            return
        self._arm(self.limits.header_timeout, self._headers_late)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
        super().connection_lost(exc)

    def _note_refused(self) -> None:
        stats = self.refused
        stats["count"] += 1
        now = time.monotonic()
        if now - stats["warned"] > WARN_EVERY:
            stats["warned"] = now
            logger.warning("%d connection(s) refused so far: over max_connections (%d)", stats["count"],
                           self.limits.max_connections)

    # ---- request deadlines ------------------------------------------------------------------------------
    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        if not self.transport.is_closing():
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(HEADER_TIMEOUT)
            self.transport.close()

    def _body_late(self) -> None:
        logger.info("a request body did not arrive within %.0f s: closing its connection", self.limits.body_timeout)
        self.transport.abort()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {"kvserve.abort": self.abort}
        if self._timer is None:  # a later request on this connection: its headers get header_timeout too
            self._arm(self.limits.header_timeout, self._headers_late)

    def on_headers_complete(self) -> None:
        self._disarm()
        names = {name for name, _ in self.headers}
        smuggled = b"content-length" in names and b"transfer-encoding" in names
        if not smuggled:
            super().on_headers_complete()
        else:
            app, self.app = self.app, _refuse_framing
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            self.cycle.keep_alive = False
        if self.cycle is not None and self.cycle.more_body and not smuggled:
            self._arm(self.limits.body_timeout, self._body_late)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # ---- writes -------------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        logger.info("a client read nothing for %.0f s: dropping its connection", self.limits.write_timeout)
        self.abort()

    def abort(self) -> None:
        """Drop the connection now (RST), whatever is still buffered for it."""
        if self.transport is not None:
            self.transport.abort()

    @property
    def stalled(self) -> bool:
        return self.flow is not None and self.flow.write_paused


def guarded_protocol(limits: EdgeLimits) -> type[GuardedProtocol]:
    """A GuardedProtocol class bound to `limits` (uvicorn instantiates the class once per connection)."""
    capped = EdgeLimits(connection_cap(limits.max_connections), limits.header_timeout, limits.body_timeout,
                        limits.write_timeout)
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": capped, "refused": {"count": 0, "warned": 0.0}})


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio accepts a burst of pending connections in one go, before the connection cap can refuse any, so
    a burst past the open-file limit makes accept() fail; asyncio then pauses accepting for a second and logs
    a traceback per failure. Those become one warning a minute: the pause is the right reaction, the
    traceback flood is not (seen in CI: 400 idle sockets against two front ends under a 256-file limit)."""
    last = {"at": float("-inf"), "count": 0}

    def handler(loop, context: dict) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        last["count"] += 1
        if time.monotonic() - last["at"] >= 60:
            last["at"] = time.monotonic()
            logger.warning("accepting paused %d time(s): out of file descriptors (a burst of connections beyond "
                           "max_connections); asyncio retries in a second", last["count"])

    loop.set_exception_handler(handler)
