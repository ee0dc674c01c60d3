"""CoreLink: one engine core as a front end talks to it: a PUSH socket to its inbox, a PULL socket on this
front end's outbox there, a reader task, the core's lifeline, and what the core last reported.

With `--data-parallel-size N` a front end holds N links; the EngineClient decides which one a request
uses (server/dispatch.py) and hears every link's messages through one callback.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import zmq
import zmq.asyncio

from engine.core.messages import Codec, CoreStats, FromCore, Ready


class CoreLink:
    def __init__(self, index: int, endpoint, client_index: int) -> None:
        self.index = index
        self.endpoint = endpoint  # CoreEndpoint
        self.client_index = client_index
        self.stats = CoreStats()
        self.ready: Ready | None = None
        self.dead = False
        self.last_heard = time.monotonic()
        self.unreported = 0  # requests sent since the core last reported its load
        self._codec = Codec(FromCore)
        self._push = self._pull = None
        self._reader: asyncio.Task | None = None

    @property
    def load(self) -> int:
        """Completions the core runs or queues, as far as this front end knows."""
        return self.stats.num_unfinished + self.unreported

    def open(self, context: zmq.asyncio.Context, on_message: Callable, on_exit: Callable) -> None:
        """Connect; `on_message(link, message)` for every message, `on_exit(link)` once the core is gone."""
        self._push = context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self.endpoint.addresses.inbox)
        self._pull = context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.connect(self.endpoint.addresses.outboxes[self.client_index])
        self._reader = asyncio.create_task(self._read(on_message), name=f"kvserve-core-reader-{self.index}")
        if self.endpoint.alive is not None:
            asyncio.get_running_loop().add_reader(self.endpoint.alive.fileno(), self._exited, on_exit)

    async def _read(self, on_message: Callable) -> None:
        codec, pull = self._codec, self._pull
        while True:
            data = await pull.recv(copy=False)
            self.last_heard = time.monotonic()
            on_message(self, codec.decode(data.buffer))

    def _exited(self, on_exit: Callable) -> None:
        asyncio.get_running_loop().remove_reader(self.endpoint.alive.fileno())
        self.dead = True
        self.stats = self.stats.as_dead()
        on_exit(self)

    def send(self, data: bytes) -> None:
        if self._push is not None and not self.dead:
            self._push.send(data, flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        if self.endpoint.alive is not None and not self.dead:
            asyncio.get_running_loop().remove_reader(self.endpoint.alive.fileno())
        if self._reader is not None:
            self._reader.cancel()
        if self._push is not None:
            self._push.close(linger=1000)
            self._pull.close(linger=0)


def summed(stats: list[CoreStats]) -> CoreStats:
    """Every counter of several cores added up, the lists (seconds by section or part) element by element;
    one core's stats as they are."""
    if len(stats) == 1:
        return stats[0]
    return CoreStats(*(_sum([getattr(s, f) for s in stats]) for f in CoreStats.__struct_fields__))


def _sum(values: list):
    if not isinstance(values[0], list):
        return sum(values)
    return [sum(v[i] for v in values if len(v) > i) for i in range(max(map(len, values)))]
