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

from engine.core.messages import (AbortRequests, AddRequest, Codec, CoreStats, EngineOutputs, LoadFailed, Loading,
                                  Ready, ToCore)
from engine.core.process import CoreAddresses
from engine.request import SamplingParams
from server.admission import Admission, EngineState
from server.core_link import CoreLink, summed
from server.dispatch import Dispatcher
from server.errors import APIError
from server.generation import Closed, Generation
from server.metrics import ServerMetrics

logger = logging.getLogger("kvserve.server")


@dataclass
class CoreEndpoint:
    """One engine core as a front end reaches it."""
    addresses: CoreAddresses
    alive: object | None = None  # Connection that turns readable (EOF) when the core exits; None: unwatched


@dataclass
class CoreConnection:
    """How one front end reaches the engine cores (`--data-parallel-size` of them): their endpoints, its index
    among front ends, the front ends' shared ready flags, and how requests are spread over the cores."""
    cores: list[CoreEndpoint]
    client_index: int = 0
    peers_ready: object | None = None  # with N > 1 front ends: shared bytes, one per front end, 1 once it is ready
    dispatch: str = "affinity"


class EngineClient:
    def __init__(self, connection: CoreConnection, settings, model: str | None = None,
                 multiprocess_dir: str | None = None):
        self.connection = connection
        self.settings = settings
        self.model = model  # as configured (None: the embedded default): what clients may call it besides its name
        self.info: Ready | None = None  # set when every core is ready
        self.tokenizer = None  # for detokenizing on the event loop; ServingContext tokenizes with a copy
        self.created = int(time.time())
        self.load_error: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.on_loaded: Callable[[], object] | None = None  # once loaded, before accepting requests
        self.links = [CoreLink(i, ep, connection.client_index) for i, ep in enumerate(connection.cores)]
        self.dispatcher = Dispatcher(len(self.links), connection.dispatch)
        self.metrics = ServerMetrics(lambda: self.stats, multiprocess_dir)
        self.admission = Admission(settings, self.metrics, connection.peers_ready)
        self._send_codec = Codec(ToCore)
        self._gens: dict[str, Generation] = {}  # engine request id -> its Generation
        self._admitting: dict[str, asyncio.Future] = {}
        self._live: set[Generation] = set()
        self._idle = asyncio.Event()
        self._context = None
        self._handlers = {EngineOutputs: self._on_outputs, Ready: self._on_ready, LoadFailed: self._on_load_failed,
                          Loading: self._on_loading}
        self._tokenizer_load: tuple[str, asyncio.Task] | None = None  # (path, its load), begun at Loading

    @property
    def stats(self) -> CoreStats:
        """The engine cores' counters, summed."""
        return summed([link.stats for link in self.links])

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._idle.set()
        self._context = zmq.asyncio.Context()
        for link in self.links:
            link.open(self._context, self._on_message, self._on_core_exit)

    async def stop(self) -> None:
        """Abort what this front end still has in the cores and close the sockets."""
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self.admission.state = EngineState.STOPPED
        for gen in list(self._live):
            gen.queue.put_nowait(Closed())
            gen.close()
        for link in self.links:
            link.close()
        if self._context is not None:
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
        """Every live request is aborted in its core; their Generations end with finish_reason abort."""
        for gen in self._live:
            self.send(AbortRequests(list(gen.engine_ids)), gen.core)

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
        gen.core = self._dispatch(prompts[0], completions)
        self._register(gen, completions, tokens)
        loop = asyncio.get_running_loop()
        admitted = []
        engine_params = replace(params, stop=[], detokenize=False)  # text work stays here
        for rid, prompt in gen.prompts.items():
            admitted.append(self._admitting.setdefault(rid, loop.create_future()))
            self.send(AddRequest(rid, prompt, engine_params, self.connection.client_index, gen.arrival), gen.core)
        try:  # the deadline covers admission too: a stuck core must not hang the request
            await gen.wait_within_deadline(asyncio.gather(*admitted))
        except BaseException:
            gen.close()
            raise
        finally:
            for rid in gen.engine_ids:
                self._admitting.pop(rid, None)
        return gen

    def _dispatch(self, prompt: list[int], completions: int) -> int:
        """The core for a request (all its prompts go to one), by prefix and load."""
        if len(self.links) == 1:
            return 0
        core = self.dispatcher.choose(prompt, [link.load for link in self.links],
                                      [not link.dead for link in self.links])
        self.links[core].unreported += completions
        return core

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

    def send(self, message, core: int = 0) -> None:
        if self.state != EngineState.DEAD:
            self.links[core].send(self._send_codec.encode(message))

    # ---- what the cores send ---------------------------------------------------------------------------
    def _on_message(self, link: CoreLink, message) -> None:
        self.admission.last_heard = min(lk.last_heard for lk in self.links if not lk.dead)
        self._handlers[type(message)](link, message)

    def _on_outputs(self, link: CoreLink, msg: EngineOutputs) -> None:
        if link.dead:  # sent before it died, read after: its requests have failed, its gauges read 0
            return
        link.stats, link.unreported = msg.stats, 0
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

    def _on_ready(self, link: CoreLink, msg: Ready) -> None:
        link.stats, link.ready = msg.stats, msg
        self.dispatcher.block_size = msg.block_size
        if all(lk.ready is not None for lk in self.links):
            asyncio.get_running_loop().create_task(self._finish_loading(msg))

    def _on_loading(self, link: CoreLink, msg: Loading) -> None:
        """A core found its tokenizer and loads the model: load the tokenizer meanwhile (once, off the loop)."""
        if self._tokenizer_load is None:
            self._tokenizer_load = (msg.tokenizer_path, asyncio.get_running_loop().create_task(
                asyncio.to_thread(_load_tokenizer, msg.tokenizer_path)))

    async def _finish_loading(self, msg: Ready) -> None:
        """Once every core is ready: the tokenizer (begun at Loading, or loaded now, off the event loop), then
        on_loaded (the front end settles its heap), and requests are accepted."""
        try:
            if msg.tokenizer_path is not None:
                early = self._tokenizer_load
                same = early is not None and early[0] == msg.tokenizer_path
                self.tokenizer = await (early[1] if same else asyncio.to_thread(_load_tokenizer, msg.tokenizer_path))
            self.info = msg
            if self.on_loaded is not None:
                self.on_loaded()
        except Exception as exc:
            logger.exception("finishing the load (tokenizer, serving context) failed")
            self._fatal(exc)
            return
        if self.state == EngineState.LOADING:
            self.admission.state = EngineState.READY
            if self.connection.peers_ready is not None:
                self.connection.peers_ready[self.connection.client_index] = 1
        logger.info("%d engine core(s) ready (%s, %s attention, %d KV blocks each): accepting requests",
                    len(self.links), msg.device, msg.backend, msg.num_kv_blocks)

    def _on_load_failed(self, link: CoreLink, msg: LoadFailed) -> None:
        self._fatal(RuntimeError(msg.message))

    def _on_core_exit(self, link: CoreLink) -> None:
        if self.state == EngineState.LOADING:
            self._fatal(RuntimeError("the engine core exited while loading the model"))
        elif self.state in (EngineState.DEAD, EngineState.STOPPED):
            return
        elif all(lk.dead for lk in self.links):
            logger.error("the engine core process died: failing %d requests", len(self._live))
            self._die("the engine core process died")
        else:
            self._lose_core(link)

    def _lose_core(self, link: CoreLink) -> None:
        """One of several cores died: its requests fail, the others go on; /health reports it."""
        gens = [gen for gen in self._live if gen.core == link.index]
        logger.error("engine core %d died: failing its %d requests; %d core(s) still serve", link.index,
                     len(gens), sum(not lk.dead for lk in self.links))
        self.admission.dead_cores.add(link.index)
        error = APIError(500, f"engine core {link.index} died", "internal_error")
        for gen in gens:
            for rid in gen.engine_ids:
                _settle(self._admitting.get(rid), error)
            gen.fail(error)

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


def _load_tokenizer(path: str):
    from engine.loader import load_tokenizer

    return load_tokenizer(path)


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
