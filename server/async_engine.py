"""The engine thread: one step loop, fed through a thread-safe inbox, feeding per-request asyncio queues.

The LLMEngine is single-threaded; only the engine thread touches it. The event loop talks to it through
`_send(command)` (add, abort, abort_all, stop) and hears back through `loop.call_soon_threadsafe`, one call
per step carrying every output of that step. The thread sleeps on a condition when there is nothing to do.

Admission (event-loop side): a request is refused with 503 while loading, draining or dead, and with 429
when the completions or prompt tokens waiting for their first token would pass the configured bounds.
Deadlines are enforced by the consumer of a Generation; an expired or abandoned Generation aborts its
engine requests, and their blocks are freed by the engine's next step.
"""
from __future__ import annotations

import asyncio
import copy
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from engine.request import FinishReason, RequestError, SamplingParams, StepOutput
from server.errors import APIError
from server.metrics import ServerMetrics
from server.settings import ServerSettings

logger = logging.getLogger("kvserve.server")

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is declared dead
SHUTDOWN_ABORT_STEPS = 16  # steps run after aborting everything at shutdown, to emit the aborts


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


class _Closed:
    """Sent to a Generation the engine thread will never feed again (shutdown): unfinished ones abort."""


@dataclass
class _Route:
    gen: "Generation"
    remaining: int  # completions of this engine request not finished yet


@dataclass
class WaitingQueue:
    """Completions and prompt tokens admitted but without a first token yet: what the waiting bounds limit."""
    max_completions: int
    max_tokens: int
    completions: int = 0
    tokens: int = 0

    def would_overflow(self, completions: int, tokens: int) -> bool:
        if self.completions == 0:  # a lone request is never refused for its own size
            return False
        return self.completions + completions > self.max_completions or self.tokens + tokens > self.max_tokens

    def add(self, completions: int, tokens: int) -> None:
        self.completions += completions
        self.tokens += tokens


class Generation:
    """One HTTP request's engine requests (one per prompt, n completions each), fed by the engine thread."""

    def __init__(self, owner: "AsyncEngine", request_id: str, prompts: list[list[int]], params: SamplingParams,
                 timeout: float | None):
        self.owner = owner
        self.request_id = request_id
        self.params = params
        self.arrival = time.monotonic()
        self.deadline = None if timeout is None else self.arrival + timeout  # monotonic, total
        qt = owner.settings.queue_timeout
        self.queue_deadline = None if qt is None else self.arrival + qt
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.prompts = dict(zip(self.engine_ids, prompts))
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.unfinished = {(rid, k) for rid in self.engine_ids for k in range(params.n)}
        self.waiting_first = set(self.engine_ids)  # engine requests without a first token yet
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self._last_token_time: dict[tuple[str, int], float] = {}

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def outputs(self):
        """Yields StepOutputs until every completion finished. Raises APIError on a deadline or engine failure."""
        try:
            while self.unfinished:
                item = await self._next()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Closed):
                    for rid, k in sorted(self.unfinished):
                        yield StepOutput(rid, k, [], "", finish_reason=FinishReason.ABORT)
                    self.unfinished.clear()
                    return
                for out in item:
                    if out.finished:
                        self.unfinished.discard((out.request_id, out.index))
                    yield out
        finally:
            self.close()

    async def _next(self):
        return await self.wait_within_deadline(self.queue.get())

    async def wait_within_deadline(self, awaitable):
        deadline = self.deadline
        if self.waiting_first and self.queue_deadline is not None:
            deadline = self.queue_deadline if deadline is None else min(deadline, self.queue_deadline)
        if deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await awaitable
        except TimeoutError:
            queue = bool(self.waiting_first) and deadline == self.queue_deadline
            self.owner.metrics.timeouts.labels("queue" if queue else "total").inc()
            what = "queue time (no first token)" if queue else "total time"
            raise APIError(408, f"request exceeded its {what} limit and was aborted", "timeout") from None

    def close(self) -> None:
        """Idempotent: abort whatever has not finished, give back the waiting-queue budget."""
        if self.closed:
            return
        self.closed = True
        for rid in list(self.waiting_first):
            self.got_first_token(rid)
        if self.unfinished:
            self.owner.send(("abort", list(self.engine_ids)))
        self.owner.forget(self)

    def got_first_token(self, rid: str) -> None:
        """`rid` leaves the waiting queue (its first token came, or the request ended without one)."""
        if rid in self.waiting_first:
            self.waiting_first.discard(rid)
            self.owner.waiting.add(-self.params.n, -len(self.prompts[rid]))

    def push(self, outs: list[StepOutput], step_start: float, step_end: float) -> None:
        """Event-loop side: one step's outputs for this request (also observes the latency metrics)."""
        if self.closed:
            return
        m = self.owner.metrics
        for out in outs:
            key = (out.request_id, out.index)
            if out.request_id in self.waiting_first and out.new_token_ids:
                self.got_first_token(out.request_id)
                m.ttft.observe(step_end - self.arrival)
                m.queue_time.observe(max(0.0, step_start - self.arrival))
            last = self._last_token_time.get(key)
            if last is not None and out.new_token_ids:
                m.itl.observe(step_end - last)
            if out.new_token_ids:
                self._last_token_time[key] = step_end
            if out.finished and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                m.e2e.observe(step_end - self.arrival)
        self.queue.put_nowait(outs)


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], object], settings: ServerSettings):
        self._factory = engine_factory
        self.settings = settings
        self.engine = None  # set once loaded; the app reads config / max_model_len / vocab_size from it
        self.tokenizer = None  # the server's own copy of the engine's tokenizer (the engine thread uses that one)
        self.state = EngineState.LOADING
        self.created = int(time.time())
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()  # set when loading ended, either way
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._stats = None  # the latest EngineStats, replaced (never mutated) by the engine thread
        self.metrics = ServerMetrics(lambda: self._stats)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._inbox_closed = False
        self._routes: dict[str, _Route] = {}  # engine thread only
        self._last_progress = time.monotonic()
        self._step_started: float | None = None
        self._live: set[Generation] = set()  # event-loop side
        self.waiting = WaitingQueue(settings.max_waiting_requests, settings.max_waiting_tokens)
        self._idle = asyncio.Event()

    # ---- lifecycle (event loop) -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        if self.state in (EngineState.LOADING, EngineState.READY):
            self.state = EngineState.DRAINING

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def abort_all(self) -> None:
        self.send(("abort_all",))

    async def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self.state = EngineState.DRAINING
        self.send(("stop",))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout)
        self.state = EngineState.STOPPED if self.state != EngineState.DEAD else self.state

    # ---- health (any thread) ----------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self.state == EngineState.DEAD:
            return False, "the engine loop died"
        if self.state == EngineState.LOADING:
            return True, "loading"
        alive = self._thread is not None and self._thread.is_alive()
        if not alive and self.state != EngineState.STOPPED:
            return False, "the engine thread is not running"
        now, limit = time.monotonic(), self.settings.watchdog_timeout
        started = self._step_started
        if started is not None and now - started > limit:
            return False, f"an engine step has run for {now - started:.0f} s"
        if (self._live or self._inbox) and now - self._last_progress > limit:
            return False, f"work is pending but the engine made no progress for {now - self._last_progress:.0f} s"
        return True, self.state.value

    def readiness(self) -> tuple[bool, str]:
        healthy, why = self.health()
        if not healthy:
            return False, why
        if self.state != EngineState.READY:
            return False, self.state.value
        if self.waiting.would_overflow(1, 0):
            return False, "overloaded"
        return True, "ready"

    # ---- admission (event loop) -------------------------------------------------------------------
    async def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                       timeout: float | None = None) -> Generation:
        """Admit one HTTP request's prompts, or raise APIError (503 / 429 / 400 from the engine)."""
        completions = len(prompts) * params.n
        if completions > self.settings.max_waiting_requests:  # could never be admitted: not an overload
            raise APIError(400, f"a request may ask for at most {self.settings.max_waiting_requests} completions "
                                "(prompts x n)", "invalid_value", "prompt")
        tokens = sum(map(len, prompts))
        self._check_admission(completions, tokens)
        limits = [t for t in (self.settings.request_timeout, timeout) if t is not None]
        gen = Generation(self, request_id, prompts, params, min(limits) if limits else None)
        self._live.add(gen)
        self._idle.clear()
        self.waiting.add(completions, tokens)
        admitted = self._loop.create_future()
        self.send(("add", gen, admitted))
        try:  # the deadline covers admission too: a stuck engine thread must not hang the request
            await gen.wait_within_deadline(admitted)
        except BaseException:
            gen.close()
            raise
        return gen

    def _check_admission(self, completions: int, tokens: int) -> None:
        retry = {"Retry-After": str(self.settings.retry_after)}
        refusals = {EngineState.LOADING: ("the model is still loading", "not_ready"),
                    EngineState.DRAINING: ("the server is shutting down", "shutting_down"),
                    EngineState.STOPPED: ("the server is shutting down", "shutting_down"),
                    EngineState.DEAD: ("the engine has failed", "engine_dead")}
        if self.state in refusals:
            message, code = refusals[self.state]
            self.metrics.rejected.labels(code).inc()
            raise APIError(503, message, code, headers=retry)
        healthy, why = self.health()
        if not healthy:
            self.metrics.rejected.labels("engine_unhealthy").inc()
            raise APIError(503, f"the engine is unhealthy: {why}", "engine_unhealthy", headers=retry)
        if self.waiting.would_overflow(completions, tokens):
            self.metrics.rejected.labels("overloaded").inc()
            raise APIError(429, "the server is overloaded: too many requests are waiting; retry later",
                           "overloaded", headers=retry)

    def forget(self, gen: Generation) -> None:
        self._live.discard(gen)
        if not self._live:
            self._idle.set()

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- the inbox --------------------------------------------------------------------------------
    def send(self, command: tuple) -> None:
        with self._cond:
            if self._inbox_closed:  # the engine thread is gone: nobody will ever read this
                _refuse(command)
                return
            self._inbox.append(command)
            self._cond.notify()

    def _close_inbox(self) -> None:
        """Engine thread, on its way out: later commands are refused at once, queued ones now."""
        with self._cond:
            self._inbox_closed = True
            commands, self._inbox = self._inbox, []
        for command in commands:
            self._to_loop(_refuse, command)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._load():
                self._serve()
        except BaseException as exc:  # the loop itself broke: fail everyone, report dead
            logger.exception("the engine loop died")
            self.state = EngineState.DEAD
            self._fail_all(APIError(500, f"the engine loop died: {type(exc).__name__}", "internal_error"))
        finally:
            self._close_inbox()

    def _load(self) -> bool:
        start = time.monotonic()
        try:
            engine = _build_leaving_a_core_for_http(self._factory)
            self.tokenizer = _own_copy(engine.tokenizer)
            self.engine = engine
            self._stats = engine.stats()
            if self.state == EngineState.LOADING:
                self.state = EngineState.READY
            logger.info("model loaded in %.1f s: accepting requests", time.monotonic() - start)
            return True
        except BaseException as exc:
            logger.exception("loading the model failed")
            self.load_error = exc
            self.state = EngineState.DEAD
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return False
        finally:
            self._last_progress = time.monotonic()
            self.loaded.set()

    def _serve(self) -> None:
        failures = 0
        busy = False
        while True:
            commands = self._wait_for_work()
            if any(c[0] == "stop" for c in commands):
                self._apply_all([c for c in commands if c[0] != "stop"])
                self._shutdown()
                return
            self._apply_all(commands)
            if commands:  # queue lengths move with adds and aborts, not only with steps
                self._stats = self.engine.stats()
            if self.engine.has_unfinished_requests():
                busy = True
                failures = self._step(failures)
                if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                    raise RuntimeError(f"{failures} engine steps in a row failed")
            elif busy:
                busy = False
                self._on_idle()
            self._last_progress = time.monotonic()

    def _wait_for_work(self) -> list[tuple]:
        with self._cond:
            while not self._inbox and not self.engine.has_unfinished_requests():
                self._last_progress = time.monotonic()
                self._cond.wait(timeout=1.0)
            commands, self._inbox = self._inbox, []
        return commands

    def _apply_all(self, commands: list[tuple]) -> None:
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(command[1], command[2])
            elif kind == "abort":
                self._abort(command[1], keep_routes=False)
            elif kind == "abort_all":
                self._abort(list(self._routes), keep_routes=True)

    def _add(self, gen: Generation, admitted: asyncio.Future) -> None:
        added = []
        try:
            for rid in gen.engine_ids:
                self.engine.add_request(rid, gen.prompts[rid], gen.params)
                added.append(rid)
                self._routes[rid] = _Route(gen, gen.params.n)
        except Exception as exc:
            self._abort(added, keep_routes=False)
            if isinstance(exc, RequestError):
                error = APIError(400, exc.message, exc.code, exc.param)
            else:
                logger.exception("add_request failed")
                error = APIError(500, "the engine could not accept the request", "internal_error")
            self._to_loop(_settle, admitted, error)
            return
        self._to_loop(_settle, admitted, None)

    def _abort(self, request_ids: list[str], keep_routes: bool) -> None:
        for rid in request_ids:
            if rid in self._routes:
                self.engine.abort_request(rid)
                if not keep_routes:  # nobody listens: the engine's abort outputs are only counted
                    del self._routes[rid]

    def _step(self, failures: int) -> int:
        start = self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed")
            self._step_started = None
            self._fail_all(APIError(500, f"engine step failed: {type(exc).__name__}", "internal_error"))
            return failures + 1
        end = time.monotonic()
        self._step_started = None
        self._stats = self.engine.stats()
        self._deliver(outputs, start, end)
        return 0

    def _deliver(self, outputs: list[StepOutput], start: float, end: float) -> None:
        batches: dict[Generation, list[StepOutput]] = {}
        for out in outputs:
            if out.finished:
                self.metrics.finished.labels(out.finish_reason.value).inc()
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            batches.setdefault(route.gen, []).append(out)
            if out.finished:
                route.remaining -= 1
                if route.remaining <= 0:
                    del self._routes[out.request_id]
        if batches:
            self._to_loop(_push_all, batches, start, end)

    def _fail_all(self, error: APIError) -> None:
        """Every routed request gets `error`; the engine is told to drop them."""
        gens = {route.gen for route in self._routes.values()}
        for rid in list(self._routes):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        self._routes.clear()
        for gen in gens:
            self._to_loop(_put, gen, error)

    def _on_idle(self) -> None:
        """Busy -> idle: one empty step lets the engine check its idle invariant; then snapshot the stats."""
        self.engine.step()
        self._stats = stats = self.engine.stats()
        if not hasattr(stats, "idle_invariant_violations"):  # an engine without its own check
            used = getattr(getattr(stats, "scheduler", None), "num_blocks_used", 0)
            if used:
                logger.error("idle invariant violated: %d KV blocks held with no live request", used)
                self.metrics.server_idle_violations += 1

    def _shutdown(self) -> None:
        self._abort(list(self._routes), keep_routes=True)
        for _ in range(SHUTDOWN_ABORT_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self._step(0)
        self._stats = self.engine.stats()
        for gen in {route.gen for route in self._routes.values()}:
            self._to_loop(_put, gen, _Closed())
        self._routes.clear()


def _build_leaving_a_core_for_http(factory):
    """factory() with torch's intra-op threads one fewer than the cores when the engine is on the CPU.
    They spin on every core between ops and starve the event loop's thread: measured 10x slower tokens on
    2 cores. Set before the engine is built, in this thread: its warm-up builds oneDNN primitives for the
    thread count it runs under, and under another count every one is built again while serving."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    engine = factory()
    device = getattr(engine, "device", None)
    if device is None or device.type != "cpu":  # a GPU engine keeps torch's default
        torch.set_num_threads(threads)
    return engine


def _own_copy(tokenizer):
    """A tokenizer for the event loop's threads. A copy, so that encoding there never contends with the engine
    thread's decoding on one Rust object; shared when it cannot be copied (encode and decode only read it)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        return tokenizer


def _refuse(command: tuple) -> None:
    """Event loop: answer a command the engine thread will never run (only an add waits for an answer)."""
    if command[0] == "add":
        _settle(command[2], APIError(503, "the engine is not running", "engine_dead"))


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _push_all(batches: dict[Generation, list[StepOutput]], start: float, end: float) -> None:
    for gen, outs in batches.items():
        gen.push(outs, start, end)


def _put(gen: Generation, item) -> None:
    if not gen.closed:
        gen.queue.put_nowait(item)
