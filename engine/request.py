"""Requests, sampling parameters and outputs: the engine's vocabulary. No torch here."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request the engine refuses. `code` is machine-readable (OpenAI style), `param` names the field."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def _check(cond: bool, param: str, message: str, code: str = "invalid_value") -> None:
    if not cond:
        raise RequestError(f"{param}: {message}", code=code, param=param)


def _is_finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutput:
    """A constraint on a completion's text: exactly one of its fields is set. Plain data, so it travels in
    SamplingParams to the engine core; engine/grammar.py turns it into a grammar."""
    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, exactly
    grammar: str | None = None  # Lark, or GBNF (`root ::= ...`)

    def param(self) -> str:
        """The field's name in `structured_outputs` (what an error names)."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return f"structured_outputs.{name}"
        return "response_format"

    def key(self) -> tuple:
        """Cache key: equal constraints share one compiled grammar."""
        return (self.json, self.json_object, self.regex, tuple(self.choice) if self.choice else None, self.grammar)

    def validate(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        _check(sum(kinds) == 1, "structured_outputs", "give exactly one of json, regex, choice, grammar")
        _check(self.choice is None or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", "must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16  # None: up to max_model_len
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks; vLLM's option of the same name)
    structured: StructuredOutput | None = None  # the grammar the output must follow
    # None: off; k: each prompt token's logprob (after the first) and the top k. Such a request computes
    # logits at every prompt position, so it takes no prefix-cache hit.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1, "n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(_is_finite_number(getattr(self, name)), name, "must be a finite number")
        _check(self.temperature >= 0, "temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1, "top_k",
               "must be an integer >= -1 (-1 or 0 disables it)")
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)), "seed",
               "must be an integer")
        _check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0,
               "min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                   and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        if self.logprobs is not None:
            _check(isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                   and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        if self.prompt_logprobs is not None:
            _check(isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                   and 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                   f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured is not None:
            self.structured.validate()
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with a structured output (the grammar "
                   "decides where the output may end)", "unsupported")
        if self.logit_bias is not None:
            _check(all(isinstance(k, int) and _is_finite_number(v) for k, v in self.logit_bias.items()),
                   "logit_bias", "must map token ids to finite numbers")

    def for_child(self, index: int) -> "SamplingParams":
        """The parameters of completion `index` of an n > 1 request: n=1, and a distinct seed if seeded."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED = "finished"


# Enum members as plain names: on Python 3.11 `RequestStatus.FINISHED` costs ~10x an `is` test, and the
# per-step loops test a status per request.
WAITING, RUNNING, PREEMPTED, FINISHED = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED,
                                         RequestStatus.FINISHED)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client gone, deadline, shutdown
    ERROR = "error"  # the model step raised


@dataclass(slots=True)  # built per request, read per step: slots make attribute access cheaper
class Request:
    """One sequence the scheduler runs (a completion: an n > 1 request is n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # The id of a sibling whose prompt KV this request waits to share through the prefix cache (n > 1).
    wait_for_prefill_of: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache (or scheduled to be, this step). Advanced at schedule time.
    num_computed_tokens: int = 0
    # Tokens sampled by a step whose results the host has not read yet (0 or 1): with async scheduling the
    # next step is scheduled, and computes them, before update() appends their values.
    num_pending_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # The matcher of a structured request (engine.structured.Grammar): it has consumed every output token,
    # so a preempted request resumes its grammar where it was (recompute changes the KV, not the tokens).
    grammar: object | None = None
    # Why it ended with FinishReason.ERROR when the request itself is at fault (its grammar cannot be
    # followed): a message and an error code for the client (a 400, not a 500).
    error: str | None = None
    error_code: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the runner calls this per step)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def token_at(self, pos: int) -> int | None:
        """all_token_ids[pos], or None when pos is the token still being sampled (async scheduling)."""
        out_pos = pos - len(self.prompt_token_ids)
        if out_pos < 0:
            return self.prompt_token_ids[pos]
        return self.output_token_ids[out_pos] if out_pos < len(self.output_token_ids) else None

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED


def completion_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of completion `index` of a request with `n` completions."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token id, logprob), best first


@dataclass(slots=True)  # one per request per step
class StepOutput:
    """What one step added to one completion: a delta. The engine returns these; LLM and the server join them."""

    request_id: str  # the caller's id
    index: int  # which of the n completions
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # set with FinishReason.ERROR
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # prompt_logprobs: the prompt's tokens from the second on, once, with the completion's first output
    prompt_logprobs: list[TokenLogprob] | None = None
    error_code: str | None = None  # with `error`, when the request is at fault (e.g. invalid_grammar)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # from the prompt's second token on
    error: str | None = None  # finish_reason "error": why (a grammar that fails to compile, a failed step)
    error_code: str | None = None  # machine-readable, when the request is at fault (e.g. invalid_grammar)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
