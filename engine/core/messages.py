"""The messages between front-end processes and the engine core: one small typed struct per kind, msgpack on
the wire (msgspec), dispatched by type. No torch here.

Front end -> core (one PUSH socket per front end, into the core's PULL):
  AddRequest, AbortRequests, Shutdown.
Core -> front end i (the core's PUSH socket i):
  Ready or LoadFailed once; then EngineOutputs per loop iteration that has something for that front end, and
  at least every HEARTBEAT_S while it is idle (a front end tells a stuck or dead core by the silence).

Token deltas are `array_like` structs: at 256 requests a step, encoding a delta as an array instead of a map
is what keeps the core's share of a step small (msgspec encodes either in well under a microsecond, but map
keys are ~4x the bytes).
"""
from __future__ import annotations

from typing import Union

import msgspec

from engine.request import SamplingParams, TokenLogprob

HEARTBEAT_S = 0.25  # the longest an idle core stays silent


class AddRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str  # unique within the engine; the front end's `client_index` routes its outputs back
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings and detokenization stay with the front end
    client_index: int
    arrival_time: float  # time.monotonic() of the front end (one clock for every process on a host)


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Ids of AddRequests (every completion), or of single completions (`completion_id`)."""
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    """From the launcher: abort what is left, emit the aborts, exit."""


class TokenDelta(msgspec.Struct, array_like=True, gc=False):
    """What one step added to one completion (engine.request.StepOutput, without text). index -1: every
    completion of `request_id` still running ended with `error` (a failed step)."""
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # with a completion's first token, when asked
    error_code: str | None = None  # set with `error` when the request is at fault: the front end answers 400


class Rejection(msgspec.Struct, array_like=True, gc=False):
    """An AddRequest the engine refused (engine.request.RequestError): nothing of it was queued."""
    request_id: str
    message: str
    code: str
    param: str | None = None


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The engine's counters at the end of a loop iteration (gauges and cumulative counters)."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    num_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    idle_invariant_violations: int = 0
    num_steps: int = 0
    num_unfinished: int = 0  # engine requests (all completions) not finished yet, every front end's
    grammar_process_restarts: int = 0  # grammar processes started again after one died (engine/grammar_link.py)
    structured_steps: int = 0  # steps sampled under grammar masks
    structured_mask_wait_seconds: float = 0.0  # the engine thread's wait for their masks, summed
    busy_seconds: float = 0.0  # the engine's time in its steps, summed
    section_seconds: list[float] = msgspec.field(default_factory=list)  # the same by section (step_clock.SECTIONS)
    device_seconds: list[float] = msgspec.field(default_factory=list)  # the device's, by part (step_clock.DEVICE_PARTS)
    grammar_worker_seconds: list[float] = msgspec.field(default_factory=list)  # by part (WORKER_TIMES)

    def as_dead(self) -> CoreStats:
        """A dead core's stats: it holds nothing, so the gauges read 0; the cumulative counters keep their last
        values (a Prometheus counter never goes down)."""
        return msgspec.structs.replace(self, num_running=0, num_waiting=0, num_blocks_total=0, num_blocks_used=0,
                                       num_blocks_cached=0, num_unfinished=0)


class EngineOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    deltas: list[TokenDelta]
    admitted: list[str]  # AddRequests queued since the last message
    rejected: list[Rejection]
    stats: CoreStats
    step_start: float = 0.0  # time.monotonic() around the step that made `deltas` (0: no step)
    step_end: float = 0.0


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The model is loaded: what the front end needs to check and render requests."""
    model_path: str
    tokenizer_path: str | None  # None: the engine runs without a tokenizer (token ids only)
    vocab_size: int
    max_model_len: int
    device: str
    backend: str
    num_kv_blocks: int
    stats: CoreStats
    block_size: int = 16
    grammar_max_size: int = 500_000  # the engine's grammar limits, for the front end's checks
    grammar_compile_fuel: int = 1_000_000


class LoadFailed(msgspec.Struct, tag=True, array_like=True, gc=False):
    message: str


class Loading(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core has found its tokenizer and now loads the model: the front end loads the tokenizer meanwhile."""
    tokenizer_path: str


ToCore = Union[AddRequest, AbortRequests, Shutdown]
FromCore = Union[EngineOutputs, Ready, LoadFailed, Loading]


class Codec:
    """One encoder and the decoder of one direction (msgspec objects are reused, never shared across threads)."""

    def __init__(self, incoming) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)

