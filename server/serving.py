"""OpenAI completions and chat completions on top of EngineClient: prompts in, JSON or SSE out.

A request's choices are numbered prompt_index * n + completion_index (OpenAI's order). Streams send a
chunk whenever a completion gains text or logprobs, or finishes; an error after the stream started is an
SSE `data: {"error": ...}` event followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid

import orjson
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from engine.request import FinishReason, StepOutput, TokenLogprob
from server.engine_client import EngineClient
from server import prompts
from server.generation import Generation
from server.errors import APIError
from server.tools import StreamReply, reply_message
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.request_params import Limits, check_prompt_ids, message_dicts

logger = logging.getLogger("kvserve.server")

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token the request made impossible gets this


@dataclass
class ServingContext:
    engine: EngineClient
    tokenizer: object  # a copy for the tokenization threads: the event loop detokenizes with the client's
    model_name: str
    limits: Limits
    max_prompt_tokens: int
    executor: ThreadPoolExecutor  # tokenization, off the event loop
    log_requests: bool = False
    model_names: tuple[str, ...] = ()  # every name a request may use (model_name first)
    max_prompt_chars: int = 1 << 62  # max_prompt_tokens x the longest token's characters
    parse_special_tokens: bool = False  # in chat message text (chat_parse_special_tokens)
    grammars: object | None = None  # server.structured.GrammarChecker
    tool_call_parser: str | None = None
    reasoning_parser: bool = False
    chat_template: str | None = None  # the server's override of the model's template
    trust_request_chat_template: bool = False  # requests may send their own template
    _token_text: dict[int, str] = field(default_factory=dict)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_for(self, request, fn, *args):
        """run(), dropped if its client hangs up first (queued work never starts: ClientGone)."""
        done = []
        result = await unless_disconnected(request, self._tagged(done, fn, *args))
        if not done:
            raise ClientGone()
        return result

    async def _tagged(self, done: list, fn, *args):
        result = await self.run(fn, *args)
        done.append(True)
        return result

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:  # skip_tokenizer_init: vLLM's spelling of a token without text
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this server runs without one "
                                "(skip_tokenizer_init): send token ids", "unsupported")
        return self.tokenizer


async def until_disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request, coro):
    """Await `coro`, cancelling it (so its generation aborts) if the client hangs up first."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return None


class ClientGone(Exception):
    """The client hung up before its response began: nothing to send (answered 499, logged at debug)."""


@dataclass
class Choice:
    """One completion as it accumulates."""
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # streaming: characters sent so far (for text_offset)
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.new_text)
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        if out.finished:
            self.finish_reason = out.finish_reason.value
            self.stop_reason = out.stop_reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def choice_index(gen: Generation, out: StepOutput) -> int:
    return gen.prompt_index[out.request_id] * gen.params.n + out.index


def check_error(out: StepOutput) -> None:
    if out.finish_reason == FinishReason.ERROR:
        raise APIError(500, out.error or "the model step failed", "internal_error")


def usage(gen: Generation, completion_tokens: int, cached: int) -> dict:
    prompt_tokens = sum(len(p) for p in gen.prompts.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def sse(data: dict | str) -> bytes:
    """One SSE event (orjson: the encoding of every chunk of every stream is on this process's hot path)."""
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


async def collect(gen: Generation) -> tuple[dict[int, Choice], int]:
    """Run a generation to the end. Returns the choices by index and the cached prompt tokens."""
    choices: dict[int, Choice] = {}
    cached: dict[str, int] = {}
    async for out in gen.outputs():
        check_error(out)
        idx = choice_index(gen, out)
        choices.setdefault(idx, Choice(idx)).add(out)
        cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
    return choices, sum(cached.values())


async def stream_events(gen: Generation, chunks, include_usage_chunk):
    """SSE framing around `chunks` (an async iterator of dicts), errors included, then [DONE]."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
        if include_usage_chunk is not None:
            yield sse(include_usage_chunk())
    except APIError as err:
        yield sse(err.body())
    except Exception:
        logger.exception("error while streaming %s", gen.request_id)
        yield sse(APIError(500, "internal server error", "internal_error").body())
    finally:
        gen.close()
    yield sse("[DONE]")


# ---- completions ------------------------------------------------------------------------------------


def echo_logprobs(ctx: ServingContext, prompt: list[int], prompt_lps: list[TokenLogprob] | None,
                  logprobs: list[TokenLogprob], offset: int) -> dict:
    """echo with logprobs: the prompt's tokens (the first with null logprobs), then the completion's (whose
    text_offset counts from `offset`, the echoed prompt's length)."""
    first = ctx.token_text(prompt[0])
    head = completion_logprobs(ctx, prompt_lps or [], len(first))
    tail = completion_logprobs(ctx, logprobs, offset)
    return {"tokens": [first] + head["tokens"] + tail["tokens"],
            "token_logprobs": [None] + head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": [None] + head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": [0] + head["text_offset"] + tail["text_offset"]}


def vllm_prompt_logprobs(ctx: ServingContext, prompt_lps: list[TokenLogprob] | None) -> list | None:
    """vLLM's shape: per prompt token, null for the first, else {token id: {logprob, decoded_token}} holding
    the token itself and the top k."""
    if prompt_lps is None:
        return None
    out: list = [None]
    for lp in prompt_lps:
        entry = {str(t): {"logprob": _finite(v), "decoded_token": ctx.token_text(t)} for t, v in lp.top}
        entry.setdefault(str(lp.token_id), {"logprob": _finite(lp.logprob), "decoded_token": ctx.token_text(lp.token_id)})
        out.append(entry)
    return out


def completion_logprobs(ctx: ServingContext, logprobs: list[TokenLogprob], offset: int) -> dict:
    """OpenAI completions shape; text_offset counts the token strings from `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in logprobs:
        text = ctx.token_text(lp.token_id)
        tokens.append(text)
        token_lps.append(_finite(lp.logprob))
        top = {ctx.token_text(t): _finite(v) for t, v in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def completion_response(ctx: ServingContext, gen: Generation, req: CompletionRequest, rid: str,
                              prompt_texts: list[str]) -> dict:
    choices, cached = await collect(gen)
    out = []
    for idx in sorted(choices):
        c = choices[idx]
        prefix = prompt_texts[idx // gen.params.n] if req.echo else ""
        lps = completion_logprobs(ctx, c.logprobs, len(prefix)) if req.logprobs is not None else None
        if req.echo and lps is not None:
            prompt = gen.prompts[gen.engine_ids[idx // gen.params.n]]
            lps = echo_logprobs(ctx, prompt, c.prompt_logprobs, c.logprobs, len(prefix))
        choice = {"index": idx, "text": prefix + "".join(c.text), "logprobs": lps,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(ctx, c.prompt_logprobs)
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        out.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in choices.values())
    if ctx.log_requests:
        logger.info("%s output: %r", rid, [c["text"] for c in out])
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": out, "usage": usage(gen, completion_tokens, cached)}


class StreamChunks:
    """The envelope all chunks of one stream share; with include_usage every chunk carries `usage: null`
    and a last chunk carries the totals (OpenAI's shape)."""

    def __init__(self, ctx: ServingContext, gen: Generation, rid: str, obj: str, stream_options) -> None:
        self.base = {"id": rid, "object": obj, "created": int(time.time()), "model": ctx.model_name}
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.gen = gen
        self.state = {"tokens": 0, "cached": {}}  # output tokens so far; cached prompt tokens per completion

    def __call__(self, choices: list[dict]) -> dict:
        body = {**self.base, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        body = self([])
        body["usage"] = usage(self.gen, self.state["tokens"], sum(self.state["cached"].values()))
        return body

    def events(self, chunks):
        return stream_events(self.gen, chunks, self.usage_chunk if self.include_usage else None)


def completion_stream(ctx: ServingContext, gen: Generation, req: CompletionRequest, rid: str,
                      prompt_texts: list[str]):
    chunk = StreamChunks(ctx, gen, rid, "text_completion", req.stream_options)
    state = chunk.state

    async def chunks():
        offsets = {}
        if req.echo:
            for idx in range(len(gen.engine_ids) * gen.params.n):
                text = prompt_texts[idx // gen.params.n]
                offsets[idx] = len(text)
                yield chunk([{"index": idx, "text": text, "logprobs": None, "finish_reason": None}])
        async for out in gen.outputs():
            check_error(out)
            idx = choice_index(gen, out)
            state["tokens"] += len(out.new_token_ids)
            state["cached"][out.request_id] = out.num_cached_tokens
            lps = None
            if req.logprobs is not None and out.new_logprobs:
                lps = completion_logprobs(ctx, out.new_logprobs, offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps["tokens"])
            if out.new_text or out.new_token_ids or out.finished:
                choice = {"index": idx, "text": out.new_text, "logprobs": lps,
                          "finish_reason": out.finish_reason.value if out.finished else None,
                          "stop_reason": out.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
                yield chunk([choice])

    return chunk.events(chunks())


# ---- chat completions ----------------------------------------------------------------------------


def chat_logprobs(ctx: ServingContext, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


async def chat_response(ctx: ServingContext, gen: Generation, req: ChatCompletionRequest, rid: str,
                        parser=None) -> dict:
    choices, cached = await collect(gen)
    out = []
    for idx, c in sorted(choices.items()):
        message, finish = reply_message("".join(c.text), parser, ctx.reasoning_parser, c.finish_reason)
        out.append({"index": idx, "message": message,
                    "logprobs": chat_logprobs(ctx, c.logprobs) if req.logprobs else None,
                    "finish_reason": finish, "stop_reason": c.stop_reason})
    if ctx.log_requests:
        logger.info("%s output: %r", rid, [c["message"]["content"] for c in out])
    completion_tokens = sum(len(c.token_ids) for c in choices.values())
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": ctx.model_name,
            "choices": out, "usage": usage(gen, completion_tokens, cached)}
    if req.prompt_logprobs is not None and choices:
        body["prompt_logprobs"] = vllm_prompt_logprobs(ctx, choices[min(choices)].prompt_logprobs)
    return body


def chat_stream(ctx: ServingContext, gen: Generation, req: ChatCompletionRequest, rid: str, parser=None):
    chunk = StreamChunks(ctx, gen, rid, "chat.completion.chunk", req.stream_options)
    state = chunk.state
    replies = {idx: StreamReply(parser, ctx.reasoning_parser) for idx in range(gen.params.n)}

    async def chunks():
        for idx in range(gen.params.n):
            yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for out in gen.outputs():
            check_error(out)
            state["tokens"] += len(out.new_token_ids)
            state["cached"][out.request_id] = out.num_cached_tokens
            lps = chat_logprobs(ctx, out.new_logprobs) if req.logprobs and out.new_logprobs else None
            if out.new_text or out.new_token_ids or out.finished:
                reply = replies[out.index]
                deltas = reply.deltas(out.new_text, out.finished) or [{}]
                finish = out.finish_reason.value if out.finished else None
                finish = reply.finish_reason(finish)
                for i, delta in enumerate(deltas):  # logprobs on the first, the finish on the last
                    last = i == len(deltas) - 1
                    yield chunk([{"index": out.index, "delta": delta, "logprobs": None if i else lps,
                                  "finish_reason": finish if last else None,
                                  "stop_reason": out.stop_reason if last else None}])

    return chunk.events(chunks())


# ---- prompts ---------------------------------------------------------------------------------------


def tokenize_texts(ctx: ServingContext, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    tokenizer = ctx.need_tokenizer("a text prompt")
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def request_template(ctx: ServingContext, req) -> str | None:
    """A template the request sends (`chat_template`, or vLLM's `chat_template_kwargs.chat_template`): a Jinja
    program the server would run, so only with --trust-request-chat-template (vLLM's rule)."""
    template = getattr(req, "chat_template", None)
    param = "chat_template"
    if template is None:
        template = (getattr(req, "chat_template_kwargs", None) or {}).get("chat_template")
        param = "chat_template_kwargs.chat_template"
    if template is not None and not ctx.trust_request_chat_template:
        raise APIError(400, f"{param}: this server does not run templates sent with requests (start it with "
                       "--trust-request-chat-template to allow them)", "unsupported", param)
    return template


def chat_template(ctx: ServingContext, req) -> str | None:
    """The request's template (when trusted), else the server's, else the model's."""
    tok = ctx.need_tokenizer("chat")
    return request_template(ctx, req) or ctx.chat_template or getattr(tok, "chat_template", None)


def template_options(req) -> dict:
    """tools, chat_template_kwargs, add_generation_prompt / continue_final_message as apply_chat_template takes them."""
    cont = bool(getattr(req, "continue_final_message", False))
    kwargs = {k: v for k, v in (getattr(req, "chat_template_kwargs", None) or {}).items() if k != "chat_template"}
    options = {**kwargs, "continue_final_message": cont,
               "add_generation_prompt": getattr(req, "add_generation_prompt", True) and not cont}
    if getattr(req, "tools", None):
        options["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return options


def chat_prompt(ctx: ServingContext, req) -> list[int]:
    """The token ids of a chat request's messages (prompts.chat_ids: message text is text), after the cheap
    checks (message count, characters)."""
    tok = ctx.need_tokenizer("chat")
    messages = message_dicts(req.messages)
    if len(messages) > ctx.limits.max_messages:
        raise APIError(400, f"messages: at most {ctx.limits.max_messages} on this server", "invalid_value",
                       "messages")
    chars = prompts.message_chars(messages)
    if chars > ctx.max_prompt_chars:
        raise prompts.too_long(chars, ctx.max_prompt_tokens, "messages")
    template = chat_template(ctx, req)
    if not template:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "unsupported")
    options = template_options(req)

    def render(msgs: list[dict]) -> str:
        try:
            return tok.apply_chat_template(msgs, tokenize=False, chat_template=template, **options)
        except Exception as exc:  # jinja's raise_exception(...) in a template: the messages broke its rules
            raise APIError(400, f"messages: the chat template refused them: {exc}", "invalid_value", "messages")

    return prompts.chat_ids(tok, messages, render, ctx.parse_special_tokens)


apply_chat_template = chat_prompt  # its name before the checks came in


def prompt_check(ctx: ServingContext, prompts_ids: list[list[int]]) -> None:
    check_prompt_ids(prompts_ids, ctx.limits.vocab_size, ctx.max_prompt_tokens)
