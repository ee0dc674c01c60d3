"""EngineCore: the engine-core process's loop. It does nothing but step: between steps it takes the adds and
aborts that arrived, after each step it sends every front end one message holding its requests' new tokens.

It never waits while the engine has work (the inbox is polled with a zero timeout, a few microseconds), and
sleeps in zmq's poll while it has none, waking for a message, for the launcher's death, or to send a
heartbeat every HEARTBEAT_S. Three steps in a row that raise outside the engine's own error handling end
the process (the front ends then report the engine dead).
"""
from __future__ import annotations

import logging
import time

import zmq

from engine.core.messages import (HEARTBEAT_S, AbortRequests, AddRequest, Codec, CoreStats, EngineOutputs,
                                  Rejection, Shutdown, ToCore, TokenDelta)
from engine.request import RequestError, StepOutput

logger = logging.getLogger("kvserve.engine_core")

MAX_CONSECUTIVE_STEP_FAILURES = 3
SHUTDOWN_ABORT_STEPS = 16  # steps run after aborting everything at shutdown, to emit the aborts


class Route:
    """Which front end an AddRequest came from, and how many of its completions are still running."""
    __slots__ = ("client", "remaining")

    def __init__(self, client: int, remaining: int) -> None:
        self.client = client
        self.remaining = remaining


class Outbox:
    """What one front end gets in the next EngineOutputs message."""
    __slots__ = ("deltas", "admitted", "rejected", "last_sent")

    def __init__(self) -> None:
        self.deltas: list[TokenDelta] = []
        self.admitted: list[str] = []
        self.rejected: list[Rejection] = []
        self.last_sent = 0.0

    def has_news(self) -> bool:
        return bool(self.deltas or self.admitted or self.rejected)

    def take(self, stats: CoreStats, start: float, end: float) -> EngineOutputs:
        message = EngineOutputs(self.deltas, self.admitted, self.rejected, stats, start, end)
        self.deltas, self.admitted, self.rejected = [], [], []
        return message


def core_stats(engine) -> CoreStats:
    s = engine.stats()
    q = s.scheduler
    return CoreStats(q.num_running, q.num_waiting, q.num_blocks_total, q.num_blocks_used, q.num_blocks_cached,
                     q.prefix_cache_queries, q.prefix_cache_hits, q.num_preemptions, s.prompt_tokens_total,
                     s.generation_tokens_total, s.idle_invariant_violations, s.num_steps,
                     q.num_running + q.num_waiting, s.grammar_process_restarts, s.structured_steps,
                     s.structured_mask_wait_seconds, s.busy_seconds, s.section_seconds or [],
                     s.device_seconds or [], s.grammar_worker_seconds or [])


def to_delta(out: StepOutput) -> TokenDelta:
    return TokenDelta(out.request_id, out.index, out.new_token_ids, out.new_logprobs, out.finish_reason,
                      out.stop_reason, out.error, out.num_prompt_tokens, out.num_cached_tokens, out.prompt_logprobs, out.error_code)


class EngineCore:
    def __init__(self, engine, inbox: zmq.Socket, outboxes: list[zmq.Socket], lifeline_fd: int | None) -> None:
        self.engine = engine
        self.inbox = inbox
        self.sockets = outboxes
        self.outboxes = [Outbox() for _ in outboxes]
        self.routes: dict[str, Route] = {}
        self.codec = Codec(ToCore)
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.lifeline_fd = lifeline_fd
        if lifeline_fd is not None:
            self.poller.register(lifeline_fd, zmq.POLLIN)
        self.stopping = False
        self.failures = 0
        self.busy = False
        self.step_end = 0.0  # perf_counter() after the last step's outputs were routed
        self.handlers = {AddRequest: self._add, AbortRequests: self._abort, Shutdown: self._shutdown_requested}

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        """Until Shutdown (or the launcher's death): receive, step, send."""
        while not self.stopping:
            if not self._receive(block=not self.engine.has_unfinished_requests()):
                return  # the launcher is gone: nobody is left to serve
            if self.stopping:
                break
            self._send_admissions()
            start = end = 0.0
            if self.engine.has_unfinished_requests():
                start, end = self._step()
            elif self.busy:
                self._on_idle()
            self._send(start, end)
        self._shutdown()

    def _receive(self, block: bool) -> bool:
        """Apply every message waiting (waiting up to HEARTBEAT_S for one if `block`). False: the launcher died."""
        events = dict(self.poller.poll(HEARTBEAT_S * 1000 if block else 0))
        if self.lifeline_fd is not None and self.lifeline_fd in events:
            logger.error("the launcher process is gone: the engine core exits")
            return False
        if self.inbox in events:
            while True:
                try:
                    data = self.inbox.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                message = self.codec.decode(data.buffer)
                self.handlers[type(message)](message)
        return True

    def _send_admissions(self) -> None:
        """Admissions go out before the step that runs them: a long step must not delay them, nor the stats
        that count the new requests as waiting (a front end that saw 0 waiting would think the engine idle)."""
        if any(box.admitted or box.rejected for box in self.outboxes):
            self._send(0.0, 0.0)

    def _send(self, start: float, end: float) -> None:
        """One EngineOutputs to each front end with news, and a heartbeat to each silent for HEARTBEAT_S."""
        now = time.monotonic()
        stats = None
        for socket, box in zip(self.sockets, self.outboxes):
            if box.has_news() or now - box.last_sent >= HEARTBEAT_S:
                stats = stats or core_stats(self.engine)
                self._post(socket, box.take(stats, start, end))
                box.last_sent = now

    def _post(self, socket: zmq.Socket, message: EngineOutputs) -> None:
        """Never blocks: the outboxes have no high-water mark, so a send can only fail when the front end is
        gone (a PUSH socket with no peer); its messages are dropped and the core serves the others."""
        try:
            socket.send(self.codec.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.debug("a front end is gone: its message is dropped")

    # ---- messages -----------------------------------------------------------------------------------
    def _add(self, msg: AddRequest) -> None:
        box = self.outboxes[msg.client_index]
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
        except RequestError as exc:
            box.rejected.append(Rejection(msg.request_id, exc.message, exc.code, exc.param))
            return
        except Exception as exc:
            logger.exception("add_request failed")
            box.rejected.append(Rejection(msg.request_id, f"the engine could not accept the request: "
                                          f"{type(exc).__name__}", "internal_error"))
            return
        self.routes[msg.request_id] = Route(msg.client_index, msg.params.n)
        box.admitted.append(msg.request_id)

    def _abort(self, msg: AbortRequests) -> None:
        """Abort outputs still reach the front end: it ignores those of requests it has closed."""
        for rid in msg.request_ids:
            self.engine.abort_request(rid)

    def _shutdown_requested(self, msg: Shutdown) -> None:
        self.stopping = True

    # ---- steps --------------------------------------------------------------------------------------
    def _step(self) -> tuple[float, float]:
        if self.busy:  # the loop's work since the last step (requests in, outputs out): the clock's "core loop"
            self.engine.clock.add("core loop", time.perf_counter() - self.step_end)
        self.busy = True
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(exc).__name__}")
            self.failures += 1
            if self.failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise RuntimeError(f"{self.failures} engine steps in a row failed") from exc
            return start, time.monotonic()
        self.failures = 0
        self._route(outputs)
        self.step_end = time.perf_counter()
        return start, time.monotonic()

    def _route(self, outputs: list[StepOutput]) -> None:
        """Hot loop (~256 outputs a step): names bound once, one dict lookup per output."""
        routes, boxes = self.routes, self.outboxes
        for out in outputs:
            route = routes.get(out.request_id)
            if route is None:
                continue
            boxes[route.client].deltas.append(to_delta(out))
            if out.finish_reason is not None:
                route.remaining -= 1
                if route.remaining <= 0:
                    del routes[out.request_id]

    def _fail_all(self, error: str) -> None:
        """Every routed request ends with `error`; the engine drops them."""
        for rid, route in self.routes.items():
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            self.outboxes[route.client].deltas.append(TokenDelta(rid, -1, [], None, "error", None, error))
        self.routes.clear()

    def _on_idle(self) -> None:
        """Busy -> idle: one empty step lets the engine check its idle invariant (and trim memory). It runs no
        request, so a failure here is logged and the core goes on."""
        self.busy = False
        try:
            self.engine.step()
        except Exception:
            logger.exception("the idle check step failed")

    def _shutdown(self) -> None:
        for rid in list(self.routes):
            self.engine.abort_request(rid)
        for _ in range(SHUTDOWN_ABORT_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self._route(self.engine.step())
        self._send(0.0, 0.0)
