"""Validated request bodies (server/protocol.py) -> the engine's SamplingParams, with the server's limits
(max_tokens, stop strings, logit_bias, n, response size) checked on the way; and chat messages as the chat
template reads them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import RequestError, SamplingParams
from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields


@dataclass
class Limits:
    vocab_size: int
    max_n: int
    max_logprobs: int
    max_stop_sequences: int
    max_stop_length: int
    max_tokens_cap: int | None
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    max_messages: int = 1024
    max_response_logprobs: int = 1 << 18
    max_model_len: int | None = None  # what an omitted max_tokens may reach (for the response-size cap)


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", code, param)


def _check_stop(stop: list[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise _bad("stop", f"at most {limits.max_stop_sequences} stop strings")
    for s in stop:
        if not s:
            raise _bad("stop", "stop strings must not be empty")
        if len(s) > limits.max_stop_length:
            raise _bad("stop", f"stop strings are at most {limits.max_stop_length} characters")


def _logit_bias(raw: dict[str, float] | None, limits: Limits) -> dict[int, float] | None:
    if not raw:
        return None
    vocab_size = limits.vocab_size
    if len(raw) > limits.max_logit_bias:
        raise _bad("logit_bias", f"at most {limits.max_logit_bias} entries on this server")
    out = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < vocab_size):
            raise _bad("logit_bias", f"keys must be token ids in [0, {vocab_size})")
        out[int(key)] = value
    return out


def check_response_size(n: int, max_tokens: int | None, logprobs: int | None, limits: Limits) -> None:
    """n x max_tokens x (logprobs + 1) logprob entries (~60 bytes of JSON each) must stay under the cap."""
    tokens = max_tokens if max_tokens is not None else limits.max_model_len
    if logprobs is None or tokens is None:
        return
    entries = n * tokens * (logprobs + 1)
    if entries > limits.max_response_logprobs:
        raise _bad("logprobs", f"n x max_tokens x (logprobs + 1) is {entries}, over this server's "
                               f"{limits.max_response_logprobs}: lower n, max_tokens or logprobs")


def _check_token_ids(ids: list[int] | None, vocab_size: int, param: str) -> None:
    if ids and max(ids) >= vocab_size:
        raise _bad(param, f"token ids must be in [0, {vocab_size})")


def _max_tokens(requested: int | None, default: int | None, limits: Limits) -> int | None:
    """An explicit max_tokens over the cap is refused; an omitted one is the default, lowered to the cap."""
    cap = limits.max_tokens_cap
    if requested is not None:
        if cap is not None and requested > cap:
            raise _bad("max_tokens", f"must be <= {cap} on this server")
        return requested
    if cap is None:
        return default
    return cap if default is None else min(default, cap)


def _or(value, default):
    return default if value is None else value


def sampling_params(req: SamplingFields, limits: Limits, max_tokens: int | None, default_max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Everything the engine needs, checked against this server's caps. Raises APIError (400)."""
    if req.n > limits.max_n:
        raise _bad("n", f"must be <= {limits.max_n} on this server")
    if req.best_of is not None and req.best_of < req.n:
        raise _bad("best_of", "must be >= n")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise _bad("logprobs", f"must be <= {limits.max_logprobs} on this server")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check_stop(stop, limits)
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise _bad("stop_token_ids", f"at most {limits.max_stop_token_ids} on this server")
    _check_token_ids(req.stop_token_ids, limits.vocab_size, "stop_token_ids")
    max_tokens = _max_tokens(max_tokens, default_max_tokens, limits)
    check_response_size(req.n, max_tokens, logprobs, limits)
    try:
        return SamplingParams(
            n=req.n, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=_or(req.top_k, -1),
            min_p=_or(req.min_p, 0.0), seed=req.seed, presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0), repetition_penalty=_or(req.repetition_penalty, 1.0),
            logit_bias=_logit_bias(req.logit_bias, limits), min_tokens=_or(req.min_tokens, 0),
            max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logprobs=logprobs, skip_special_tokens=_or(req.skip_special_tokens, True))
    except RequestError as err:
        raise APIError(400, err.message, err.code, err.param) from None


def completion_params(req: CompletionRequest, limits: Limits) -> SamplingParams:
    return sampling_params(req, limits, req.max_tokens, 16, req.logprobs)


def prompt_logprobs_of(req, limits: Limits) -> int | None:
    """How many top logprobs each prompt token needs: vLLM's prompt_logprobs, or completions' echo with
    logprobs (the OpenAI shape lm-evaluation-harness reads). Not with stream (refused)."""
    k = req.prompt_logprobs
    if getattr(req, "echo", False) and getattr(req, "logprobs", None) is not None:
        k = max(k or 0, req.logprobs)
    if k is None:
        return None
    if k > limits.max_logprobs:
        raise _bad("prompt_logprobs", f"must be <= {limits.max_logprobs} on this server")
    if req.stream:
        raise _bad("prompt_logprobs", "prompt logprobs are not streamed by kvserve: use stream: false",
                   "unsupported")
    return k


def chat_params(req: ChatCompletionRequest, limits: Limits) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # top_logprobs without logprobs is ignored (OpenAI refuses it; being lenient keeps the schema honest)
    return sampling_params(req, limits, max_tokens, None, (req.top_logprobs or 0) if req.logprobs else None)


def check_num_completions(num_prompts: int, n: int, limits: Limits) -> None:
    if num_prompts * n > limits.max_n:
        raise _bad("n", f"prompts x n must be <= {limits.max_n} on this server")


def check_prompt_ids(prompts: list[list[int]], vocab_size: int, max_prompt_tokens: int) -> None:
    for ids in prompts:
        if not ids:
            raise _bad("prompt", "must not be empty")
        _check_token_ids(ids, vocab_size, "prompt")
        if len(ids) > max_prompt_tokens:
            raise APIError(400, f"prompt is {len(ids)} tokens, more than the {max_prompt_tokens} allowed",
                           "context_length_exceeded", "prompt")


def split_prompt(prompt) -> tuple[list[str], list[list[int]]]:
    """A validated `prompt` -> (texts to tokenize, token-id prompts); exactly one of the two is non-empty."""
    if isinstance(prompt, str):
        return [prompt], []
    if not prompt:
        raise _bad("prompt", "must not be empty")
    if isinstance(prompt[0], str):
        return list(prompt), []
    if isinstance(prompt[0], int):
        return [], [list(prompt)]
    return [], [list(p) for p in prompt]


def _arguments(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template expects them: text parts joined into one string."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        d = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:  # arguments as objects: what HF chat templates (Qwen, Llama, Mistral) render
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        out.append(d)
    return out
