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
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # context_len: tokens already in the KV cache before this step
    num_new_tokens: int  # query_len: tokens computed this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a new token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


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
