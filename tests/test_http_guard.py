"""server/http_guard.py and the stream deadline, on a real uvicorn with a fire-hose app: the writes of a
client that reads nothing block for sure (megabytes a second, a 4 KiB receive buffer), which a tiny model on
a busy CPU cannot promise (tests/test_reliability_edges.py checks the same promises on the real server)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from server.app import SSEResponse
from server.http_guard import EdgeLimits, guarded_protocol
from server_utils import free_port

CHUNK = b"x" * 65536


def fire_hose(state: dict, deadline_in: float | None):
    """An ASGI app that streams CHUNK forever (as SSEResponse when deadline_in is set); records how it ended."""
    async def chunks():
        try:
            while True:
                await asyncio.sleep(0)  # as the real streams do (they await the engine's next outputs)
                yield CHUNK
                state["sent"] = state.get("sent", 0) + len(CHUNK)
        finally:
            state["ended"] = time.monotonic()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        deadline = None if deadline_in is None else time.monotonic() + deadline_in
        await SSEResponse(chunks(), deadline)(scope, receive, send)

    return app


@pytest.fixture
def serve():
    running = []

    def start(app, write_timeout: float) -> int:
        port = free_port()
        limits = EdgeLimits(max_connections=16, header_timeout=5, body_timeout=5, write_timeout=write_timeout)
        server = uvicorn.Server(uvicorn.Config(app, port=port, http=guarded_protocol(limits), log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        while not server.started:
            time.sleep(0.02)
        return port

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


def stuck_client(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def wait_for(state: dict, key: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while key not in state and time.monotonic() < end:
        time.sleep(0.05)
    return key in state


def test_write_timeout_drops_a_client_that_reads_nothing(serve):
    state = {}
    port = serve(fire_hose(state, None), write_timeout=1.0)
    sock = stuck_client(port)
    start = time.monotonic()
    assert wait_for(state, "ended", 10), "the response to a client that reads nothing never ended"
    assert state["ended"] - start < 5 and state["sent"] >= 4 * len(CHUNK)  # it did block: megabytes queued
    sock.settimeout(5)
    try:  # the connection ends: what was in flight, then EOF or a reset (never a timeout)
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    sock.close()


def test_a_stream_blocked_on_writing_still_ends_at_its_deadline(serve):
    """write_timeout 60 s, deadline 1 s: the stream ends (connection dropped) DEADLINE_GRACE after its deadline."""
    state = {}
    port = serve(fire_hose(state, 1.0), write_timeout=60.0)
    sock = stuck_client(port)
    start = time.monotonic()
    assert wait_for(state, "ended", 10), "a stream blocked on writing outlived its deadline"
    assert 1.0 <= state["ended"] - start < 4
    sock.close()


def test_a_connection_over_the_cap_gets_503(serve):
    port = serve(fire_hose({}, 0.5), write_timeout=1.0)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
    extra = socket.create_connection(("127.0.0.1", port))
    extra.settimeout(5)
    assert extra.recv(100).startswith(b"HTTP/1.1 503")
    for s in socks + [extra]:
        s.close()


def test_accept_failures_from_a_burst_become_one_warning_without_traceback(caplog):
    """CI saw a burst of 400 sockets make accept() fail with EMFILE before the cap could refuse them, and
    asyncio logged a traceback per failure; now one warning a minute, other loop errors untouched."""
    import asyncio
    import errno
    import logging

    from server.http_guard import quiet_accept_errors

    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            loop.call_exception_handler({"message": "something else", "exception": RuntimeError("boom")})
    finally:
        loop.close()
    text = caplog.text
    assert text.count("accepting paused") == 1 and "Too many open files" not in text
    assert "something else" in text  # the default handler still reports the rest
