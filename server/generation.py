"""Generation: one HTTP request's engine requests (one per prompt, n completions each), fed with token deltas
by the EngineClient's reader and consumed by the response (JSON or SSE).

Text work happens here, in the process that owns the stream: each completion's incremental detokenizer
turns token ids into text and finds stop strings; a stop string ends the completion at once and aborts it in
the engine core (which may already have run a step or two past it: those tokens are dropped).

A consumer that falls behind gets every delta waiting for a completion merged into one (one SSE chunk, legal
in the OpenAI stream format), instead of one event per token; with stream_interval k a completion's tokens go
out k at a time (and whatever is left when it finishes).
"""
from __future__ import annotations

import asyncio
import time

from engine.core.messages import AbortRequests, TokenDelta
from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason, SamplingParams, StepOutput, completion_id
from server.errors import APIError


class Closed:
    """Sent to a Generation the engine core will never feed again (shutdown): unfinished ones abort."""


class Expired:
    """Put in a Generation's queue by its deadline timer: the consumer checks which deadline, if any, passed."""


EXPIRED = Expired()


class Completion:
    """Front-end state of one completion: its text so far (detokenizer) and its tokens not yet handed out."""
    __slots__ = ("engine_id", "index", "detok", "finished", "tokens", "logprobs", "num_cached", "prompt_logprobs")

    def __init__(self, engine_id: str, index: int, detok: IncrementalDetokenizer | None) -> None:
        self.engine_id, self.index, self.detok = engine_id, index, detok
        self.finished = False
        self.tokens: list[int] = []  # held back by stream_interval
        self.logprobs: list | None = None
        self.num_cached = 0
        self.prompt_logprobs: list | None = None  # until handed out with the next output


class TokenTimes:
    """When one completion's first and latest tokens came (ends of engine steps) and how many: its latency
    metrics."""
    __slots__ = ("first", "last", "count")

    def __init__(self, now: float, count: int) -> None:
        self.first = self.last = now
        self.count = count

    def time_per_output_token(self) -> float:
        """vLLM's per-request TPOT: the decode time over the tokens after the first (0 for one token)."""
        return (self.last - self.first) / (self.count - 1) if self.count > 1 else 0.0


class Generation:
    def __init__(self, owner, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 timeout: float | None, tokenizer, stream_interval: int = 1):
        self.owner = owner
        self.core = 0  # which engine core runs it (with --data-parallel-size N)
        self.request_id = request_id
        self.params = params
        self.arrival = time.monotonic()
        self.deadline = None if timeout is None else self.arrival + timeout  # monotonic, total
        qt = owner.settings.queue_timeout
        self.queue_deadline = None if qt is None else self.arrival + qt
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.prompts = dict(zip(self.engine_ids, prompts))
        self.prompt_index = {rid: i for i, rid in enumerate(self.engine_ids)}
        self.completions = {(rid, k): self._completion(rid, k, tokenizer) for rid in self.engine_ids
                            for k in range(params.n)}
        self.unfinished = set(self.completions)
        self.waiting_first = set(self.engine_ids)  # engine requests without a first token yet
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.stream_interval = stream_interval
        self._token_times: dict[str, TokenTimes] = {}  # by f"{engine request id}#{completion index}"
        self._alarm: asyncio.TimerHandle | None = None  # rings (EXPIRED) at _alarm_at, the deadline then in force
        self._alarm_at: float | None = None

    def _completion(self, rid: str, index: int, tokenizer) -> Completion:
        detok = None
        if tokenizer is not None and self.params.detokenize:
            params = self.params.for_child(index) if self.params.n > 1 else self.params
            detok = IncrementalDetokenizer(tokenizer, self.prompts[rid], params)
        return Completion(rid, index, detok)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    # ---- the consumer's side ----------------------------------------------------------------------
    async def outputs(self):
        """Yields StepOutputs (with text) until every completion finished. Raises APIError on a deadline or an
        engine failure."""
        try:
            while self.unfinished:
                deltas = await self._next_deltas()
                if deltas is None:  # Closed: the engine core will send nothing more
                    for key in sorted(self.unfinished):
                        yield self._finish(self.completions[key], FinishReason.ABORT, None, "", [], None)
                    return
                for out in self._apply(deltas):
                    yield out
        finally:
            self.close()

    async def _next_deltas(self) -> list[TokenDelta] | None:
        """Every delta waiting (at least one), or None once Closed. Hot path: a wait arms no timer of its own;
        one alarm per deadline puts EXPIRED in the queue (asyncio.timeout around each wait cost 3.6 us of a
        front end's ~45 us per streamed token), and deltas already waiting are taken after a check by hand."""
        if not self.queue.empty():
            self._check_deadline()
        deltas: list[TokenDelta] = []
        got = False  # a delta list came (even an empty one)
        while True:
            if self.queue.empty():
                if got:
                    return deltas
                self._arm_alarm()
                item = await self.queue.get()
            else:
                item = self.queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Closed):
                return None
            if item is EXPIRED:
                self._check_deadline()  # else it rang for a deadline no longer in force (the first token came)
            else:
                deltas += item
                got = True

    def _check_deadline(self) -> None:
        deadline = self._deadline()
        if deadline is not None and time.monotonic() >= deadline:
            raise self._timed_out(deadline)

    def _arm_alarm(self) -> None:
        """The alarm set for the deadline now in force (one timer per deadline, not per wait)."""
        deadline = self._deadline()
        if deadline == self._alarm_at:
            return
        self._disarm()
        if deadline is not None:
            self._alarm_at = deadline
            self._alarm = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._ring)

    def _ring(self) -> None:
        self._alarm = self._alarm_at = None  # rung: a wait after a stale ring arms it again
        self.queue.put_nowait(EXPIRED)

    def _disarm(self) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
        self._alarm = self._alarm_at = None

    def _apply(self, deltas: list[TokenDelta]) -> list[StepOutput]:
        merged: dict[tuple[str, int], list[TokenDelta]] = {}
        for d in deltas:
            keys = [(d.request_id, d.index)] if d.index >= 0 else [k for k in self.completions if k[0] == d.request_id]
            for key in keys:
                merged.setdefault(key, []).append(d)
        self._raise_errors(merged)
        outs = []
        for key, ds in merged.items():
            comp = self.completions[key]
            out = self._advance(comp, ds)
            if out is not None:
                out.prompt_logprobs, comp.prompt_logprobs = comp.prompt_logprobs, None
                outs.append(out)
        return outs

    def _raise_errors(self, merged: dict[tuple[str, int], list[TokenDelta]]) -> None:
        """A failed step ends every completion it ran (each counted) and the request with a 500."""
        failed = [(key, ds[-1]) for key, ds in merged.items()
                  if ds[-1].finish_reason == "error" and not self.completions[key].finished]
        for key, _ in failed:
            self._finish(self.completions[key], FinishReason.ERROR, None, "", [], None)
        if failed:
            d = failed[0][1]
            if d.error_code is not None:  # the request's own fault, e.g. a grammar that cannot be followed
                raise APIError(400, d.error, d.error_code)
            raise APIError(500, d.error or "the model step failed", "internal_error")

    def _advance(self, comp: Completion, deltas: list[TokenDelta]) -> StepOutput | None:
        """Fold one completion's deltas in; the StepOutput to hand out now, or None (nothing, or held back)."""
        if comp.finished:
            return None
        last = deltas[-1]
        for d in deltas:
            comp.tokens += d.token_ids
            if d.logprobs:
                comp.logprobs = (comp.logprobs or []) + d.logprobs
            comp.num_cached = max(comp.num_cached, d.num_cached_tokens)
            if d.prompt_logprobs is not None:  # [] for a one-token prompt: still asked
                comp.prompt_logprobs = d.prompt_logprobs
        reason = FinishReason(last.finish_reason) if last.finish_reason is not None else None
        if reason is None and len(comp.tokens) < self.stream_interval:
            return None
        tokens, logprobs = comp.tokens, comp.logprobs
        comp.tokens, comp.logprobs = [], None
        text, stop = self._text(comp, tokens, reason is not None)
        if stop is not None:
            cut = stop[1]
            tokens, logprobs = tokens[:cut], (logprobs[:cut] if logprobs else logprobs)
            if reason is None:
                self.owner.send(AbortRequests([completion_id(comp.engine_id, comp.index, self.params.n)]), self.core)
            return self._finish(comp, FinishReason.STOP, stop[0], text, tokens, logprobs)
        if reason is not None:
            return self._finish(comp, reason, last.stop_reason, text, tokens, logprobs)
        return StepOutput(comp.engine_id, comp.index, tokens, text, logprobs, None, None, None,
                          len(self.prompts[comp.engine_id]), comp.num_cached)

    def _text(self, comp: Completion, tokens: list[int], finishing: bool) -> tuple[str, tuple[str, int] | None]:
        """The tokens' text, and (stop string, tokens up to and including the one that completed it) on a hit."""
        if comp.detok is None:
            return "", None
        pieces = []
        for i, token in enumerate(tokens):
            piece, stop_str = comp.detok.add([token])
            pieces.append(piece)
            if stop_str is not None:
                return "".join(pieces), (stop_str, i + 1)
        if finishing:
            pieces.append(comp.detok.flush())
        return "".join(pieces), None

    def _finish(self, comp: Completion, reason: FinishReason, stop_reason, text: str, tokens: list[int],
                logprobs) -> StepOutput:
        comp.finished = True
        self.unfinished.discard((comp.engine_id, comp.index))
        metrics, e2e = self.owner.metrics, time.monotonic() - self.arrival
        metrics.finished.labels(reason.value).inc()
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            metrics.e2e.observe(e2e)
        times = self._token_times.get(f"{comp.engine_id}#{comp.index}")
        metrics.vllm.finished(reason.value, e2e, times.time_per_output_token() if times else 0.0, self.core)
        return StepOutput(comp.engine_id, comp.index, tokens, text, logprobs, reason, stop_reason, None,
                          len(self.prompts[comp.engine_id]), comp.num_cached)

    def _deadline(self) -> float | None:
        """The earliest limit now in force: the total one, and the queue one until the first token."""
        deadline = self.deadline
        if self.waiting_first and self.queue_deadline is not None:
            deadline = self.queue_deadline if deadline is None else min(deadline, self.queue_deadline)
        return deadline

    async def wait_within_deadline(self, awaitable):
        deadline = self._deadline()
        if deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await awaitable
        except TimeoutError:
            raise self._timed_out(deadline) from None

    def _timed_out(self, deadline: float) -> APIError:
        queue = bool(self.waiting_first) and deadline == self.queue_deadline
        self.owner.metrics.timeouts.labels("queue" if queue else "total").inc()
        what = "queue time (no first token)" if queue else "total time"
        return APIError(408, f"request exceeded its {what} limit and was aborted", "timeout")

    def close(self) -> None:
        """Idempotent: abort whatever has not finished, give back the waiting-queue budget."""
        if self.closed:
            return
        self.closed = True
        self._disarm()
        for rid in list(self.waiting_first):
            self.got_first_token(rid)
        if self.unfinished:
            self.owner.send(AbortRequests(list(self.engine_ids)), self.core)
            self.owner.metrics.finished.labels("abort").inc(len(self.unfinished))
        self.owner.forget(self)

    # ---- the reader's side --------------------------------------------------------------------------
    def got_first_token(self, rid: str) -> None:
        """`rid` leaves the waiting queue (its first token came, or the request ended without one)."""
        if rid in self.waiting_first:
            self.waiting_first.discard(rid)
            self.owner.admission.waiting.add(-self.params.n, -len(self.prompts[rid]))

    def push(self, deltas: list[TokenDelta], step_start: float, step_end: float) -> None:
        """One message's deltas for this request; observes the latency metrics as they arrive."""
        if self.closed:
            return
        m = self.owner.metrics
        for d in deltas:
            if not d.token_ids:
                continue
            rid = d.request_id
            if rid in self.waiting_first:
                self.got_first_token(rid)
                m.ttft.observe(step_end - self.arrival)
                m.vllm.first_token(step_end - self.arrival, self.core)
                m.queue_time.observe(max(0.0, step_start - self.arrival))
            self._observe_token_gap(f"{rid}#{d.index}", len(d.token_ids), step_end)
        self.queue.put_nowait(deltas)

    def _observe_token_gap(self, key: str, count: int, step_end: float) -> None:
        times = self._token_times.get(key)
        if times is None:
            self._token_times[key] = TokenTimes(step_end, count)
            return
        self.owner.metrics.itl.observe(step_end - times.last)
        self.owner.metrics.vllm.token_gap(step_end - times.last, self.core)
        times.last = step_end
        times.count += count

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self.queue.put_nowait(error)
