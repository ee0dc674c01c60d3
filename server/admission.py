"""Admission and health of one front-end process: its state, its share of the waiting queue, and the rules
that refuse a request (503 while loading, draining or dead; 429 when the waiting bounds would be passed).

The waiting bounds count completions and prompt tokens admitted by this front end that have no first token
yet. /health is 200 while the engine core is alive and heard from: a core silent for watchdog_timeout while
this front end has work in it (a step that hangs) is unhealthy, as is a dead one.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from server.errors import APIError


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


_REFUSALS = {EngineState.LOADING: ("the model is still loading", "not_ready"),
             EngineState.DRAINING: ("the server is shutting down", "shutting_down"),
             EngineState.STOPPED: ("the server is shutting down", "shutting_down"),
             EngineState.DEAD: ("the engine has failed", "engine_dead")}


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


class Admission:
    def __init__(self, settings, metrics, peers_ready=None) -> None:
        self.settings = settings
        self.peers_ready = peers_ready  # front ends sharing the listening socket: /ready waits for all of them
        self.metrics = metrics
        self.state = EngineState.LOADING
        self.dead_reason = "the engine has failed"
        self.waiting = WaitingQueue(settings.max_waiting_requests, settings.max_waiting_tokens)
        self.last_heard = time.monotonic()  # the engine core's last message (the stalest live core's)
        self.dead_cores: set[int] = set()  # with several engine cores: the ones that died (the rest serve)

    def health(self, has_work: bool) -> tuple[bool, str]:
        """Unhealthy: the engine is dead, a step is stuck, or one of several engine cores died (the others
        still serve, but only a restart brings the lost one back: the orchestrator should do it)."""
        if self.state == EngineState.DEAD:
            return False, self.dead_reason
        stalled = self._stalled(has_work)
        if stalled:
            return False, stalled
        if self.dead_cores:
            return False, f"engine core(s) {sorted(self.dead_cores)} died; the others still serve"
        return True, self.state.value

    def _stalled(self, has_work: bool) -> str:
        silent = time.monotonic() - self.last_heard
        if has_work and self.state != EngineState.LOADING and silent > self.settings.watchdog_timeout:
            return f"an engine step has made no progress for {silent:.1f} s while work is pending"
        return ""

    def readiness(self, has_work: bool) -> tuple[bool, str]:
        healthy, why = self.health(has_work)
        if not healthy:
            return False, why
        if self.state != EngineState.READY:
            return False, self.state.value
        if self.peers_ready is not None and not all(self.peers_ready):
            return False, f"{sum(self.peers_ready)} of {len(self.peers_ready)} front ends are ready"
        if self.waiting.would_overflow(1, 0):
            return False, "overloaded"
        return True, "ready"

    def check(self, completions: int, tokens: int, has_work: bool) -> None:
        """Raise the APIError that refuses a request of `completions` and `tokens` now, if any."""
        if completions > self.settings.max_waiting_requests:  # could never be admitted: not an overload
            raise APIError(400, f"a request may ask for at most {self.settings.max_waiting_requests} completions "
                                "(prompts x n)", "invalid_value", "prompt")
        if self.state in _REFUSALS:
            message, code = _REFUSALS[self.state]
            self._refuse(APIError(503, message, code, headers=self._retry()))
        stalled = self._stalled(has_work)
        if stalled:
            self._refuse(APIError(503, f"the engine is unhealthy: {stalled}", "engine_unhealthy",
                                  headers=self._retry()))
        if self.waiting.would_overflow(completions, tokens):
            self._refuse(APIError(429, "the server is overloaded: too many requests are waiting; retry later",
                                  "overloaded", headers=self._retry()))

    def _refuse(self, error: APIError) -> None:
        self.metrics.rejected.labels(error.code).inc()
        raise error

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after)}
