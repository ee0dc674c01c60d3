"""One grammar process as the engine holds it (GrammarLink's shards each hold one): the process, the socket
pair its Steps and Filled answers go over, the ZeroMQ sockets of its compiles, and the futures of those
compiles. engine/grammar_worker.py is the other end; engine/grammar_link.py drives the steps.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import zmq

from engine.grammar_messages import Compiled, Ready
from engine.request import RequestError, StructuredOutput

logger = logging.getLogger(__name__)

POLL_MS = 200  # how often a wait for the worker checks that it still lives
SEND_TIMEOUT_MS = 3000  # a send waits this long for its peer (a connection still being made), then gives up
READY_TIMEOUT_S = 120.0  # a worker that has not started by then (importing torch, the tokenizer) is given up
LOST = "the grammar process exited; the request's grammar state is lost"
WORKER_COMMAND = (sys.executable, "-m", "engine.grammar_worker")  # then: SPEC_FILE STEP_FD COMPILE REPLY MASK_FD


@dataclass(frozen=True)
class CompiledConstraint:
    """What a compile's future holds: the constraint, and the engine (grammar_messages.ENGINES) that compiled it."""
    constraint: StructuredOutput
    engine: str


class GrammarProcessError(RuntimeError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class GrammarProcess:
    """One grammar process: its sockets, and the futures of its compiles in flight. Its thread reads the worker's
    Ready (on the step socket, which nothing else touches until then), sends the compiles queued meanwhile,
    then resolves every Compiled. So a new worker starts without stopping the engine: the compiles wait for it,
    the steps of unconstrained requests do not (a restart stalled every request 3-5 s on the CPU)."""

    def __init__(self, spec: bytes, mask_fd: int) -> None:
        self.context = zmq.Context()
        self.compile_sock = self.context.socket(zmq.PUSH)
        reply = self.context.socket(zmq.PULL)
        self.folder = tempfile.mkdtemp(prefix="kvserve-g-")  # short: ipc paths must stay under ~100 bytes
        addrs = [f"ipc://{self.folder}/{name}" for name in ("compile", "reply")]
        for sock, addr in zip((self.compile_sock, reply), addrs):
            sock.bind(addr)
        with tempfile.NamedTemporaryFile(prefix="kvserve-grammar-", suffix=".pkl", delete=False) as f:
            f.write(spec)
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([*WORKER_COMMAND, f.name, str(theirs.fileno()), *addrs, str(mask_fd)],
                                     pass_fds=(mask_fd, theirs.fileno()), env=_worker_env())
        theirs.close()
        self.step = Connection(ours.detach())  # Steps and their answers (engine/grammar_worker.py STEP_FD)
        self._answers, self._polled = select.poll(), -1  # the step channel's end: poll() without a selector a call
        self.compiles: dict[int, tuple[Future, StructuredOutput]] = {}  # Compile.key -> (future, constraint)
        self.stopped = False
        self.ready = threading.Event()  # set once the Ready is read, or the worker is given up
        self.ready_error: str | None = None
        self._lock = threading.Lock()  # the compile socket and its queue: the engine's thread and this one's
        self._queued: list[bytes] | None = []  # compiles sent before Ready; None once Ready is read
        self.thread = threading.Thread(target=self._serve, args=(reply, f.name), daemon=True,
                                       name="kvserve-grammar-replies")
        self.thread.start()

    def alive(self) -> bool:
        return not self.stopped and self.proc.poll() is None

    def compile(self, data: bytes) -> None:
        """Send a Compile now, or once the worker is ready."""
        with self._lock:
            if self._queued is None:
                self.send_compile(data)
            else:
                self._queued.append(data)

    def send_compile(self, data: bytes) -> None:
        """Send, waiting at most SEND_TIMEOUT_MS for the peer: a socket whose peer is gone (the worker closed
        it, so it is exiting) would block forever, while one whose connection is still being made (the compile
        socket right after Ready: CI once sent before it was up) needs a moment. Past that the worker is killed,
        and the waits that follow see it gone."""
        try:
            if not self.compile_sock.poll(SEND_TIMEOUT_MS, zmq.POLLOUT):
                raise zmq.Again()
            self.compile_sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            self._kill("the grammar process is not connected: killing it")

    def answered(self, spin_s: float, timeout_s: float) -> bool:
        """Whether an answer (or the channel's end) is there to read: polled without blocking for spin_s, then
        waited for, up to timeout_s in all."""
        answers, spin_s = self._poller(), min(spin_s, timeout_s)
        if spin_s > 0:
            end = time.perf_counter() + spin_s
            while time.perf_counter() < end:
                if answers.poll(0):
                    return True
        return bool(answers.poll(max(0, int((timeout_s - spin_s) * 1000))))

    def _poller(self) -> select.poll:
        """The poll object of the step channel's current end (tests replace the channel)."""
        fd = self.step.fileno()
        if fd != self._polled:
            self._answers, self._polled = select.poll(), fd
            self._answers.register(fd, select.POLLIN)
        return self._answers

    def send_step(self, data: bytes) -> None:
        """A Step to the worker; one that left (its end closed) is killed, and the waits that follow see it gone."""
        try:
            self.step.send_bytes(data)
        except OSError:
            self._kill("the grammar process closed its step channel: killing it")

    def _kill(self, why: str) -> None:
        logger.error(why)
        self.proc.kill()
        self.proc.wait()

    def exit_code(self) -> int:
        """Once its end of the step channel closed: the worker's exit code (killed if it lingers)."""
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill("the grammar process closed its step channel but did not exit: killing it")
            return self.proc.returncode

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once the worker is ready, else why not."""
        if not self.ready.wait(timeout_s):
            return f"no grammar process after {timeout_s:.0f} s"
        return self.ready_error

    def _serve(self, reply: zmq.Socket, spec_file: str) -> None:
        with reply:
            self._read_ready(spec_file)
            if self.ready_error is not None:
                logger.error("the grammar process did not start: %s", self.ready_error)
            with self._lock:
                queued, self._queued = self._queued, None
                for data in queued if self.ready_error is None else []:
                    self.send_compile(data)
            self._resolve_compiles(reply)

    def _read_ready(self, spec_file: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not self.step.poll(POLL_MS / 1000):
                if not self.alive() or time.monotonic() > deadline:
                    self.ready_error = f"no grammar process (exit code {self.proc.poll()})"
                    return
            self.ready_error = msgspec.msgpack.decode(self.step.recv_bytes(), type=Ready).error
        except (EOFError, OSError):  # its end closed: it exited
            self.ready_error = f"no grammar process (exit code {self.exit_code()})"
        finally:
            with contextlib.suppress(FileNotFoundError):  # the worker removes it once read
                os.unlink(spec_file)
            self.ready.set()

    def _resolve_compiles(self, reply: zmq.Socket) -> None:
        """Each Compiled resolves its future (a CompiledConstraint, which new_grammar sends on). Once the worker
        is gone every compile waiting, or registered later, fails, until stop()."""
        decoder = msgspec.msgpack.Decoder(Compiled)
        while not self.stopped:
            if reply.poll(POLL_MS):
                _resolve(decoder.decode(reply.recv()), self.compiles)
            elif self.proc.poll() is not None:
                _fail_all(self.compiles)
        _fail_all(self.compiles)

    def stop(self) -> None:
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=5)
        self.step.close()
        self.compile_sock.close(linger=0)
        self.context.term()
        shutil.rmtree(self.folder, ignore_errors=True)


def _resolve(msg: Compiled, compiles: dict[int, tuple[Future, StructuredOutput]]) -> None:
    future, constraint = compiles.pop(msg.key, (None, None))
    if future is None:
        return
    if msg.error is None:
        future.set_result(CompiledConstraint(constraint, msg.engine))
    elif msg.code is not None:
        future.set_exception(RequestError(msg.error, msg.code, msg.param))
    else:
        future.set_exception(GrammarProcessError(msg.error))


def _fail_all(compiles: dict[int, tuple[Future, StructuredOutput]]) -> None:
    for key in list(compiles):
        future, _ = compiles.pop(key, (None, None))
        if future is not None and not future.done():
            future.set_exception(GrammarProcessError(LOST))


def _worker_env() -> dict[str, str]:
    """The engine's environment, with this checkout importable and no GPU (the worker maps host memory only)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def kill_all(workers: list[GrammarProcess]) -> None:
    """At exit (or when the link is collected unshut): every worker's process killed, its socket folder gone."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.kill()
        shutil.rmtree(worker.folder, ignore_errors=True)
