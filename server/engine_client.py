"""EngineClient: a front-end process's end of the engine core (engine/core/). It sends AddRequest and
AbortRequests over one ZeroMQ PUSH socket, and a reader task takes the core's messages off this front end's
PULL socket and routes every token delta to its Generation. Nothing here holds a lock the core needs: the core
is another process.

Admission (server/admission.py) runs before anything is sent. A Generation is returned once the core has
admitted every one of its prompts, so an error the engine finds (a prompt too long for the KV pool) is a 4xx
before any response has started. The core's death is seen at once, from its lifeline pipe: every live
request ends with an error, /health and /ready turn 503. A dead core is not restarted (its KV cache and
requests are gone): the orchestrator restarts the server, as it would a dead pod (docs/design.md).
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import zmq
import zmq.asyncio

from engine.core.messages import (AbortRequests, AddRequest, Codec, CoreStats, EngineOutputs, FromCore,
                                  LoadFailed, Ready, ToCore)
from engine.core.process import CoreAddresses
from engine.request import SamplingParams
from server.admission import Admission, EngineState
from server.errors import APIError
from server.generation import Closed, Generation
from server.metrics import ServerMetrics

logger = logging.getLogger("kvserve.server")


@dataclass
class CoreConnection:
    """How one front end reaches the core: the addresses, its index among front ends, the core's lifeline."""
    addresses: CoreAddresses
    client_index: int = 0
    core_alive: object | None = None  # Connection that turns readable (EOF) when the core exits; None: unwatched
    peers_ready: object | None = None  # with N > 1 front ends: shared bytes, one per front end, 1 once it is ready


class EngineClient:
    def __init__(self, connection: CoreConnection, settings, model: str | None = None,
                 multiprocess_dir: str | None = None):
        self.connection = connection
        self.settings = settings
        self.model = model  # as configured (None: the embedded default): what clients may call it besides its name
        self.info: Ready | None = None  # set when the core is ready
        self.tokenizer = None  # for detokenizing on the event loop; ServingContext tokenizes with a copy
        self.created = int(time.time())
        self.load_error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.stats = CoreStats()
        self.metrics = ServerMetrics(lambda: self.stats, multiprocess_dir)
        self.admission = Admission(settings, self.metrics, connection.peers_ready)
        self._codec = Codec(FromCore)
        self._send_codec = Codec(ToCore)
        self._gens: dict[str, Generation] = {}  # engine request id -> its Generation
        self._admitting: dict[str, asyncio.Future] = {}
        self._live: set[Generation] = set()
        self._idle = asyncio.Event()
        self._reader: asyncio.Task | None = None
        self._context = self._push = self._pull = None
        self._handlers = {EngineOutputs: self._on_outputs, Ready: self._on_ready, LoadFailed: self._on_load_failed}

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._idle.set()
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self.connection.addresses.inbox)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.connect(self.connection.addresses.outboxes[self.connection.client_index])
        self._reader = asyncio.create_task(self._read(), name="kvserve-engine-reader")
        if self.connection.core_alive is not None:
            asyncio.get_running_loop().add_reader(self.connection.core_alive.fileno(), self._on_core_exit)

    async def stop(self) -> None:
        """Abort what this front end still has in the core and close the sockets."""
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self.admission.state = EngineState.STOPPED
        for gen in list(self._live):
            gen.queue.put_nowait(Closed())
            gen.close()
        if self.connection.core_alive is not None:
            asyncio.get_running_loop().remove_reader(self.connection.core_alive.fileno())
        if self._reader is not None:
            self._reader.cancel()
        if self._context is not None:
            self._push.close(linger=1000)
            self._pull.close(linger=0)
            self._context.term()

    @property
    def state(self) -> EngineState:
        return self.admission.state

    def begin_drain(self) -> None:
        if self.state in (EngineState.LOADING, EngineState.READY):
            self.admission.state = EngineState.DRAINING

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def abort_all(self) -> None:
        """Every live request is aborted in the core; their Generations end with finish_reason abort."""
        ids = [rid for gen in self._live for rid in gen.engine_ids]
        if ids:
            self.send(AbortRequests(ids))

    # ---- health ---------------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        return self.admission.health(bool(self._live))

    def readiness(self) -> tuple[bool, str]:
        return self.admission.readiness(bool(self._live))

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def waiting(self):
        return self.admission.waiting

    # ---- requests ---------------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                       timeout: float | None = None) -> Generation:
        """Admit one HTTP request's prompts, or raise APIError (503 / 429, or 4xx from the engine)."""
        completions, tokens = len(prompts) * params.n, sum(map(len, prompts))
        self.admission.check(completions, tokens, bool(self._live))
        limits = [t for t in (self.settings.request_timeout, timeout) if t is not None]
        gen = Generation(self, request_id, prompts, params, min(limits) if limits else None, self.tokenizer,
                         self.settings.stream_interval)
        self._register(gen, completions, tokens)
        loop = asyncio.get_running_loop()
        admitted = []
        engine_params = replace(params, stop=[], detokenize=False)  # text work stays here
        for rid, prompt in gen.prompts.items():
            admitted.append(self._admitting.setdefault(rid, loop.create_future()))
            self.send(AddRequest(rid, prompt, engine_params, self.connection.client_index, gen.arrival))
        try:  # the deadline covers admission too: a stuck core must not hang the request
            await gen.wait_within_deadline(asyncio.gather(*admitted))
        except BaseException:
            gen.close()
            raise
        finally:
            for rid in gen.engine_ids:
                self._admitting.pop(rid, None)
        return gen

    def _register(self, gen: Generation, completions: int, tokens: int) -> None:
        for rid in gen.engine_ids:
            self._gens[rid] = gen
        self._live.add(gen)
        self._idle.clear()
        self.admission.waiting.add(completions, tokens)

    def forget(self, gen: Generation) -> None:
        for rid in gen.engine_ids:
            self._gens.pop(rid, None)
        self._live.discard(gen)
        if not self._live:
            self._idle.set()

    def send(self, message) -> None:
        if self._push is None or self.state == EngineState.DEAD:
            return
        self._push.send(self._send_codec.encode(message), flags=zmq.NOBLOCK, copy=False)

    # ---- the reader --------------------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            data = await self._pull.recv(copy=False)
            self.admission.last_heard = time.monotonic()
            message = self._codec.decode(data.buffer)
            self._handlers[type(message)](message)

    def _on_outputs(self, msg: EngineOutputs) -> None:
        self.stats = msg.stats
        for rid in msg.admitted:
            _settle(self._admitting.get(rid), None)
        for r in msg.rejected:
            status = 500 if r.code == "internal_error" else 400
            _settle(self._admitting.get(r.request_id), APIError(status, r.message, r.code, r.param))
        if msg.deltas:
            self._deliver(msg)

    def _deliver(self, msg: EngineOutputs) -> None:
        """Hot path (one call per step): the deltas grouped by Generation, one push each."""
        gens, batches = self._gens, {}
        for d in msg.deltas:
            gen = gens.get(d.request_id)
            if gen is not None:
                batches.setdefault(gen, []).append(d)
        for gen, deltas in batches.items():
            gen.push(deltas, msg.step_start, msg.step_end)

    def _on_ready(self, msg: Ready) -> None:
        self.stats = msg.stats
        asyncio.get_running_loop().create_task(self._finish_loading(msg))

    async def _finish_loading(self, msg: Ready) -> None:
        """The tokenizer loads here (off the event loop) once the core says where it is."""
        try:
            if msg.tokenizer_path is not None:
                from engine.loader import load_tokenizer

                self.tokenizer = await asyncio.to_thread(load_tokenizer, msg.tokenizer_path)
        except Exception as exc:
            logger.exception("loading the tokenizer failed")
            self._fatal(exc)
            return
        self.info = msg
        if self.state == EngineState.LOADING:
            self.admission.state = EngineState.READY
            if self.connection.peers_ready is not None:
                self.connection.peers_ready[self.connection.client_index] = 1
        logger.info("engine core ready (%s, %s attention, %d KV blocks): accepting requests", msg.device,
                    msg.backend, msg.num_kv_blocks)

    def _on_load_failed(self, msg: LoadFailed) -> None:
        self._fatal(RuntimeError(msg.message))

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.connection.core_alive.fileno())
        if self.state == EngineState.LOADING:
            self._fatal(RuntimeError("the engine core exited while loading the model"))
        elif self.state not in (EngineState.DEAD, EngineState.STOPPED):
            logger.error("the engine core process died: failing %d requests", len(self._live))
            self._die("the engine core process died")

    def _fatal(self, exc: BaseException) -> None:
        if self.load_error is None and self.info is None:
            self.load_error = exc
        self._die(f"loading failed: {exc}")
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _die(self, reason: str) -> None:
        self.admission.state = EngineState.DEAD
        self.admission.dead_reason = reason
        error = APIError(500, reason, "internal_error")
        for future in self._admitting.values():
            _settle(future, error)
        for gen in list(self._live):
            gen.fail(error)


def own_copy(tokenizer):
    """A tokenizer for the tokenization threads: a copy, so that encoding there never contends with decoding on
    the event loop on one Rust object; shared when it cannot be copied (encode and decode only read it)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        return tokenizer


def _settle(future: asyncio.Future | None, error: BaseException | None) -> None:
    if future is None or future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
