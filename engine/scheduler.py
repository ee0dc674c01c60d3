"""Continuous batching in the manner of vLLM V1. No torch here.

CONTRACT (fixed; the scheduler helper fills in the bodies):
  Scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching)
  .add_request(req)           raises RequestError(code="context_length_exceeded") when prompt + max_tokens
                              exceeds max_model_len or could never fit in the whole pool
  .schedule() -> SchedulerOutput
  .update(out, sampled: dict[request_id, token_id]) -> list[Request]
                              appends sampled tokens, applies EOS / stop_token_ids / min_tokens / max_tokens /
                              max_model_len, frees finished requests; returns the requests that got a token
  .finish_request(request_id, reason, stop_reason=None)   abort or stop string: frees everything it holds
  .has_unfinished() -> bool
  .stats() -> SchedulerStats
  .check_idle_invariant() -> int   with no live request: blocks neither free nor evictable cache (leaks; 0)

Behaviour: running requests first (admission order), then waiting ones FCFS; a prompt longer than the budget
is chunked over steps; a request short of blocks preempts the most recently admitted running request
(recompute, output kept, back to the front of the queue). Prefix-cache blocks are registered in update(),
after the step that wrote them ran. Without max_tokens, generation also ends where the KV pool ends.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager, cdiv
from engine.request import RUNNING, FinishReason, Request, RequestError, RequestStatus


@dataclass(slots=True)  # one per running request per step
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # context_len: tokens already in the KV cache before this step
    num_new_tokens: int  # query_len: tokens computed this step
    # This step reaches the end of the request's tokens (pending ones included), so it samples a new one.
    # Fixed at schedule time: update() may run after later steps were scheduled.
    samples: bool = False


@dataclass
class SchedulerOutput:
    """The one contract between scheduler and runner."""

    scheduled: list[ScheduledRequest]  # prefills (num_new_tokens > 1) first, then decodes
    num_batched_tokens: int
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step: runner drops their state

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int  # held by live requests (not counting evictable prefix cache)
    num_blocks_cached: int  # evictable prefix-cache blocks
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_cache_hits: int  # of those, tokens found, cumulative
    num_preemptions: int  # cumulative


class Scheduler:
    """One token budget per step, no prefill/decode phases: running requests first (in admission order),
    then waiting ones first come, first served. num_computed_tokens advances at schedule time."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A sequence can never hold more K/V than the whole pool: generation without max_tokens stops there.
        self.max_seq_len = min(max_model_len, num_blocks * block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests by id
        self._finished_ids: list[str] = []  # freed since the last schedule()
        self._num_preemptions = self._cache_queries = self._cache_hits = 0

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestError with nothing queued."""
        if request.num_prompt_tokens == 0:
            raise RequestError("prompt must not be empty", param="prompt")
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        self._check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """add_request's size checks without queueing (a request that waits for its grammar first)."""
        self._check_fits(request)

    def _check_fits(self, request: Request) -> None:
        p, max_tokens = request.num_prompt_tokens, request.max_tokens
        # Without max_tokens only the prompt and one generated token must fit.
        total = p + (max_tokens if max_tokens is not None else 1)
        asked = f"{p} prompt tokens" + (f" + max_tokens={max_tokens}" if max_tokens is not None else "")
        if total > self.max_model_len:
            param = "max_tokens" if max_tokens is not None and p < self.max_model_len else "prompt"
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the request "
                               f"asks for {asked}", code="context_length_exceeded", param=param)
        if cdiv(total, self.block_size) > self.pool.num_blocks:
            param = "max_tokens" if max_tokens is not None and p < self.max_seq_len else "prompt"
            raise RequestError(f"The KV cache holds {self.pool.num_blocks * self.block_size} tokens in all; the "
                               f"request asks for {asked}", code="context_length_exceeded", param=param)

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Finish a live request at any moment (abort, stop string, failed step); unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, stop_reason)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if request.status is RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- schedule -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        budget = self._schedule_running(self.max_num_batched_tokens, scheduled, preempted)
        if not preempted:  # blocks are short: let the running requests have them first
            budget = self._schedule_waiting(budget, scheduled)
        scheduled.sort(key=lambda sr: sr.num_new_tokens <= 1)  # stable: prefills first, then decodes
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted, finished)

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> int:
        running, i = self.running, 0
        while i < len(running) and budget > 0:  # every running request, every step: kept to plain reads
            request = running[i]
            pending = request.num_pending_tokens
            end = len(request.prompt_token_ids) + len(request.output_token_ids) + pending  # pending included
            start = request.num_computed_tokens
            num_new = min(end - start, budget)
            if num_new > 0 and not (pending and self._will_finish(request, end)):
                if not self._allocate_or_preempt(request, num_new, preempted):
                    break  # it preempted itself: it was the last one
                scheduled.append(self._scheduled(request, start, num_new, end))
                budget -= num_new
            i += 1
        return budget

    @staticmethod
    def _scheduled(request: Request, num_computed: int, num_new: int, end: int) -> ScheduledRequest:
        """Advance the request by num_new tokens from num_computed. `end`: its token count, pending ones
        included; reaching it samples a new token, pending until update() reads it."""
        samples = num_computed + num_new == end
        request.num_pending_tokens += samples
        request.num_computed_tokens = num_computed + num_new
        return ScheduledRequest(request, num_computed, num_new, samples)

    def _will_finish(self, request: Request, end: int) -> bool:
        """A pending token that is certain to end the request by length: nothing more to compute for it.
        `end`: the request's token count, pending ones included. Called only with a token pending."""
        max_tokens = request.sampling_params.max_tokens
        num_out = end - len(request.prompt_token_ids)
        return (max_tokens is not None and num_out >= max_tokens) or end >= self.max_seq_len

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        # Victims come from the end of `running`, after `request`: none was scheduled yet in this step.
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Drop the request's K/V; it keeps its output tokens, is recomputed, and goes first in line."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return budget  # no one to admit, or no room: most decode steps, spared building step_tokens
        step_tokens = {sr.request.request_id: sr.num_new_tokens for sr in scheduled}
        skipped: list[Request] = []  # waiting on a sibling's prompt: they keep their place in line
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending_tokens:
                break  # preempted while its last token was in flight: admitted after update() reads it
            if self._waits_for_sibling(request, step_tokens):
                skipped.append(self.waiting.popleft())
                continue
            sr = self._admit(request, budget)
            if sr is None:
                break  # first come, first served: nobody overtakes a request short of blocks
            self.waiting.popleft()
            scheduled.append(sr)
            step_tokens[request.request_id] = sr.num_new_tokens
            budget -= sr.num_new_tokens
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _waits_for_sibling(self, request: Request, step_tokens: dict[str, int]) -> bool:
        """n > 1: wait until the sibling's prompt K/V is written by an earlier step (so in the prefix cache)."""
        sibling = self.requests.get(request.wait_for_prefill_of) if request.wait_for_prefill_of else None
        if sibling is None or not self.enable_prefix_caching:
            return False
        written = sibling.num_computed_tokens - step_tokens.get(sibling.request_id, 0)
        return written < sibling.num_prompt_tokens

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        # prompt_logprobs need the logits of every prompt position: no prefix-cache hit for those requests
        hit_blocks, num_hit = ([], 0) if request.sampling_params.prompt_logprobs is not None else (
            self.kv.get_computed_blocks(request))
        num_new = min(request.num_tokens - num_hit, budget)
        if not self.kv.allocate_slots(request, num_new, hit_blocks):
            return None
        if self.enable_prefix_caching:
            self._cache_queries += request.num_tokens
            self._cache_hits += num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._scheduled(request, num_hit, num_new, request.num_tokens + request.num_pending_tokens)

    # ---- update ---------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """After the step ran: register newly full blocks, append sampled tokens, finish what stops.
        Returns the requests that got a token (finished ones included), in scheduled order."""
        got_token = []
        requests, caching = self.requests, self.enable_prefix_caching
        for sr in out.scheduled:
            request = sr.request
            if requests.get(request.request_id) is not request:
                continue  # finished (aborted) since it was scheduled
            token = None
            if sr.samples:
                request.num_pending_tokens -= 1
                token = sampled.get(request.request_id)
                if token is not None:
                    request.output_token_ids.append(token)
            if caching and request.status is RUNNING:  # not preempted since: its blocks are still its own
                self.kv.cache_full_blocks(request, sr.num_computed_tokens + sr.num_new_tokens)
            if token is None:
                continue
            stop = self._stop_condition(request)
            if stop is not None:
                self._finish(request, *stop)
            got_token.append(request)
        return got_token

    def _stop_condition(self, request: Request) -> tuple[FinishReason, int | None] | None:
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        # min_tokens: that many tokens come before any EOS / stop token (the sampler masks them too).
        if num_out > params.min_tokens:
            token = request.output_token_ids[-1]
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if (params.max_tokens is not None and num_out >= params.max_tokens) or (
                len(request.prompt_token_ids) + num_out >= self.max_seq_len):
            return FinishReason.LENGTH, None
        return None

    # ---- observability --------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_blocks_total=self.pool.num_blocks,
            num_blocks_used=self.pool.num_used_blocks, num_blocks_cached=self.pool.num_cached_blocks,
            prefix_cache_queries=self._cache_queries, prefix_cache_hits=self._cache_hits,
            num_preemptions=self._num_preemptions)

    def check_idle_invariant(self) -> int:
        """With no live request: the number of blocks neither free nor evictable cache (leaked; should be 0).
        With live requests there is nothing to check and it returns 0."""
        if self.requests:
            return 0
        return self.pool.num_used_blocks
