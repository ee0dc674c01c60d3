"""create_app(client, settings): the FastAPI app, its routes, errors, auth, limits and metrics.

Bodies are parsed here, not by FastAPI: strict UTF-8, strict JSON (no NaN / Infinity), an object at the
top, then a strict pydantic model. The OpenAPI schema still declares each body and every error response.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from server import __version__
from server.http_guard import quiet_accept_errors
from server.engine_client import EngineClient, own_copy
from server.errors import APIError, from_validation_errors, install_handlers
from server.metrics import CONTENT_TYPE
from server.middleware import APIKeyMiddleware, BodyLimitMiddleware, BodyTooLarge
from server import protocol as P
from server import request_params as RP
from server import responses as R
from server import serving, tools
from server.prompts import check_chars, max_token_chars
from server.settings import ServerSettings
from server.structured import GrammarChecker, structured_output
from engine.grammar import GrammarLimits
from engine.request import RequestError

logger = logging.getLogger("kvserve.server")

_ERRORS = {code: {"model": R.ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 429, 431, 500, 503)}
# One server-sent event (OpenAPI 3.1 describes a stream by its events): `data` is a JSON chunk, an error
# object, or [DONE] at the end.
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, then [DONE]; or an error object"},
                   "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}}}


DEADLINE_GRACE = 1.0  # seconds past a stream's deadline before its connection is dropped


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so an abandoned stream aborts its request at once.

    A stream past its deadline normally ends itself (an error event, then [DONE]); one whose client reads
    nothing cannot, as it waits to write. DEADLINE_GRACE seconds later its connection is dropped
    (http_guard's `kvserve.abort`), which ends the response and aborts the request: a stream never outlives
    its deadline by more than that, and never holds a shutdown up."""

    media_type = "text/event-stream"

    def __init__(self, content, deadline: float | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.deadline = deadline  # time.monotonic()

    async def __call__(self, scope, receive, send):
        abort = scope.get("extensions", {}).get("kvserve.abort")
        guard = None
        if self.deadline is not None and abort is not None:
            delay = max(0.0, self.deadline + DEADLINE_GRACE - time.monotonic())
            guard = asyncio.get_running_loop().call_later(delay, abort)
        try:
            await super().__call__(scope, receive, send)
        finally:
            if guard is not None:
                guard.cancel()
            await self.body_iterator.aclose()


def create_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    # FastAPIOffline: /docs serves Swagger UI's files from the fastapi-offline package, not from a CDN
    app = FastAPIOffline(title="kvserve", version=__version__, lifespan=_lifespan(client, settings),
                         docs_url="/docs", redoc_url=None, static_url="/docs-assets")
    app.state.engine = client
    app.state.settings = settings
    app.state.ctx = None  # ServingContext, built once the model is loaded
    client.metrics.name_engines(model_names(client.model, settings)[0],  # the vllm:* series' labels
                                lambda: {link.index: link.stats for link in client.links})
    install_handlers(app)
    app.add_exception_handler(serving.ClientGone, _client_gone)
    _add_routes(app, client)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-API-Key"])
    app.openapi = lambda: _openapi(app)
    return app


def _lifespan(client: EngineClient, settings: ServerSettings):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        executor = ThreadPoolExecutor(max_workers=settings.tokenizer_workers, thread_name_prefix="kvserve-tokenize")
        app.state.executor = executor
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop)
        logger.info("front end %d: event loop %s.%s", os.getpid(), type(loop).__module__, type(loop).__name__)
        await client.start()
        try:
            yield
        finally:
            await client.stop()
            executor.shutdown(wait=True, cancel_futures=True)
            if app.state.ctx is not None:
                app.state.ctx.grammars.shutdown()

    return lifespan


def serving_context(app: FastAPI) -> serving.ServingContext:
    """Built on first use after loading: the tokenizer and model limits come from the engine."""
    if app.state.ctx is not None:
        return app.state.ctx
    aengine: EngineClient = app.state.engine
    if aengine.info is None:
        raise APIError(503, "the model is still loading", "not_ready",
                       headers={"Retry-After": str(app.state.settings.retry_after)})
    s, eng = app.state.settings, aengine.info
    limits = RP.Limits(vocab_size=eng.vocab_size, max_n=s.max_n, max_logprobs=s.max_logprobs,
                      max_stop_sequences=s.max_stop_sequences, max_stop_length=s.max_stop_length,
                      max_tokens_cap=s.max_tokens_cap, max_stop_token_ids=s.max_stop_token_ids,
                      max_logit_bias=s.max_logit_bias, max_messages=s.max_messages,
                      max_response_logprobs=s.max_response_logprobs, max_model_len=eng.max_model_len)
    max_prompt = min(s.max_prompt_tokens or eng.max_model_len, eng.max_model_len)
    tokenizer = own_copy(aengine.tokenizer)
    names = model_names(aengine.model, s)
    max_chars = max_prompt * max_token_chars(tokenizer) if tokenizer is not None else 1 << 62
    app.state.ctx = serving.ServingContext(aengine, tokenizer, names[0], limits, max_prompt, app.state.executor,
                                           s.log_requests, names, max_chars, s.chat_parse_special_tokens)
    app.state.ctx.tool_call_parser, app.state.ctx.reasoning_parser = s.tool_call_parser, s.reasoning_parser
    app.state.ctx.chat_template = _read_template(s.chat_template)
    app.state.ctx.trust_request_chat_template = s.trust_request_chat_template
    app.state.ctx.grammars = GrammarChecker(app.state.ctx.tokenizer, eng.vocab_size,
                                            GrammarLimits(eng.grammar_max_size, eng.grammar_compile_fuel))
    return app.state.ctx


def _read_template(value: str | None) -> str | None:
    """--chat-template: a file's contents when it names a file, else the template itself."""
    if value and "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


def model_names(model: str | None, settings: ServerSettings) -> tuple[str, ...]:
    """--served-model-name's names (the first is reported), else one name from the model path."""
    if settings.served_model_name:
        return tuple(settings.served_model_name)
    if model is None:
        return ("SmolLM2-135M-Instruct",)
    return (model if not Path(model).exists() else Path(model).resolve().name,)


def check_model(ctx: serving.ServingContext, requested: str | None, configured: str | None) -> None:
    """A missing model is fine (one model is served); a wrong one is 404."""
    if requested is None or requested in ctx.model_names or requested == configured:
        return
    raise APIError(404, f"model {requested[:100]!r} does not exist; this server serves {ctx.model_name!r}",
                   "model_not_found", "model")


async def read_json(request: Request) -> dict:
    ctype = request.headers.get("content-type")
    if ctype is not None:
        mime = ctype.split(";")[0].strip().lower()
        if not (mime == "application/json" or mime.endswith("+json")):
            raise APIError(415, "Content-Type must be application/json", "unsupported_media_type")
    try:
        raw = await request.body()
    except ClientDisconnect:  # it hung up mid-body: nobody to answer, nothing to log
        raise serving.ClientGone() from None
    except BodyTooLarge:
        raise APIError(413, f"request body is larger than {request.app.state.settings.max_body_bytes} bytes",
                       "request_too_large") from None
    return parse_json_object(raw)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("number out of range")
    return value


def parse_json_object(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the body is not valid UTF-8", "invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the body is not valid JSON: {str(exc)[:120]}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_json")
    return body


def parse_model(cls: type[BaseModel], body: dict):
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors(include_input=False)) from None


async def _client_gone(_: Request, exc: serving.ClientGone) -> Response:
    logger.debug("a client hung up before its response began")
    return Response(status_code=499)


def _add_routes(app: FastAPI, aengine: EngineClient) -> None:
    _add_openai_routes(app, aengine)
    _add_tokenizer_routes(app)
    _add_ops_routes(app, aengine)


def _add_openai_routes(app: FastAPI, aengine: EngineClient) -> None:
    @app.post("/v1/completions", responses={200: {"model": R.CompletionResponse, "content": _SSE}, **_ERRORS},
              openapi_extra=_body_schema(P.CompletionRequest))
    async def completions(request: Request):
        ctx = serving_context(app)
        req = parse_model(P.CompletionRequest, await read_json(request))
        check_model(ctx, req.model, aengine.model)
        params = await _with_structured(ctx, req, RP.completion_params(req, ctx.limits))
        texts, prompts = RP.split_prompt(req.prompt)
        RP.check_num_completions(len(texts or prompts), params.n, ctx.limits)
        RP.check_response_size(len(texts or prompts) * params.n, params.max_tokens, params.logprobs, ctx.limits)
        if texts:
            check_chars(texts, ctx.max_prompt_chars, ctx.max_prompt_tokens)
            prompts = await ctx.run_for(request, serving.tokenize_texts, ctx, texts, req.add_special_tokens)
        serving.prompt_check(ctx, prompts)
        if req.echo and not texts:
            texts = await ctx.run_for(request, lambda: [ctx.tokenizer.decode(p) if ctx.tokenizer else ""
                                                        for p in prompts])
        if params.stop:
            ctx.need_tokenizer("a stop string")
        rid = serving.new_id("cmpl")
        _log_request(ctx, rid, texts or prompts, prompts)
        gen = await aengine.generate(rid, prompts, params, req.timeout)
        return await _respond(request, req.stream, gen, lambda: serving.completion_stream(ctx, gen, req, rid, texts),
                              lambda: serving.completion_response(ctx, gen, req, rid, texts))

    @app.post("/v1/chat/completions",
              responses={200: {"model": R.ChatCompletionResponse, "content": _SSE}, **_ERRORS},
              openapi_extra=_body_schema(P.ChatCompletionRequest))
    async def chat_completions(request: Request):
        ctx = serving_context(app)
        req = parse_model(P.ChatCompletionRequest, await read_json(request))
        check_model(ctx, req.model, aengine.model)
        serving.request_template(ctx, req)  # refused before any work when the server does not trust them
        params = await _with_structured(ctx, req, RP.chat_params(req, ctx.limits))
        parser = await _tool_calls(ctx, req, params)
        prompt = await ctx.run_for(request, serving.chat_prompt, ctx, req)
        serving.prompt_check(ctx, [prompt])
        rid = serving.new_id("chatcmpl")
        _log_request(ctx, rid, [RP.message_dicts(req.messages)], [prompt])
        gen = await aengine.generate(rid, [prompt], params, req.timeout)
        return await _respond(request, req.stream, gen, lambda: serving.chat_stream(ctx, gen, req, rid, parser),
                              lambda: serving.chat_response(ctx, gen, req, rid, parser))

    @app.get("/v1/models", response_model=R.ModelList, responses=_ERRORS)
    async def models():
        ctx = serving_context(app)
        return {"object": "list", "data": [_model_card(aengine, name) for name in ctx.model_names]}

    # {model:path}: a served name may hold a slash (org/name); the openai client sends it as %2F
    @app.get("/v1/models/{model:path}", response_model=R.ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str):
        """A name the completion routes accept: its card from /v1/models (the model path, also accepted,
        gets the reported name's card); any other name: 404 model_not_found, as the completion routes say."""
        ctx = serving_context(app)
        check_model(ctx, model, aengine.model)
        return _model_card(aengine, model if model in ctx.model_names else ctx.model_name)


def _model_card(aengine: EngineClient, name: str) -> dict:
    """One served name as /v1/models lists it (R.ModelCard)."""
    return {"id": name, "object": "model", "created": aengine.created, "owned_by": "kvserve",
            "max_model_len": aengine.info.max_model_len}


async def _with_structured(ctx: serving.ServingContext, req, params):
    """The request's constraint (response_format, structured_outputs, guided_*), checked off the event loop
    (a bad one is a 400 before the engine sees it), into its SamplingParams. First, any field kvserve
    would not honour is refused (400 unsupported)."""
    P.check_unsupported(req)
    params.prompt_logprobs = RP.prompt_logprobs_of(req, ctx.limits)
    so = structured_output(req)
    if so is None:
        return params
    await ctx.grammars.check(so)
    params.structured = so
    _check_params(params)
    return params


def _check_params(params) -> None:
    """SamplingParams' own checks again, after a constraint was added."""
    try:
        params.validate()
    except RequestError as err:
        raise APIError(400, err.message, err.code, err.param) from None


async def _tool_calls(ctx: serving.ServingContext, req, params):
    """The parser of the reply's tool calls (None: plain text); a forced call (tool_choice required or named)
    becomes the request's grammar."""
    parser = tools.tool_parser(req, ctx.tool_call_parser, serving.chat_template(ctx, req))
    await _check_tool_schemas(ctx, req)
    forced = tools.forced_call_grammar(req, parser)
    if forced is not None:
        if params.structured is not None:
            raise APIError(400, "tool_choice: a forced tool call cannot be combined with response_format",
                           "invalid_value", "tool_choice")
        await ctx.grammars.check(forced)
        params.structured = forced
        _check_params(params)
    return parser


async def _check_tool_schemas(ctx: serving.ServingContext, req) -> None:
    """Each tool's `parameters` must be a JSON schema the grammar engine takes, whatever tool_choice is (as
    OpenAI refuses one): with `auto` a bad one would otherwise reach only the chat template, silently. A 400
    invalid_grammar naming the tool; the checks are cached by schema (server/structured.py GrammarChecker)."""
    for i, so in enumerate(tools.parameter_schemas(req)):
        try:
            await ctx.grammars.check(so)
        except APIError as err:
            where = f"tools[{i}].function.parameters"
            raise APIError(400, f"{where}: {err.message.partition(': ')[2] or err.message}", err.code, where) from None


async def _respond(request: Request, stream: bool, gen, make_stream, make_body) -> Response:
    """An SSE stream, or the whole JSON body once ready (499 when the client left before it was)."""
    if stream:
        return SSEResponse(make_stream(), gen.deadline)
    body = await serving.unless_disconnected(request, make_body())
    return JSONResponse(body) if body is not None else Response(status_code=499)


def _add_tokenizer_routes(app: FastAPI) -> None:
    @app.post("/tokenize", response_model=R.TokenizeResponse, responses=_ERRORS,
              openapi_extra=_body_schema(P.TokenizeRequest))
    async def tokenize(request: Request):
        ctx = serving_context(app)
        req = parse_model(P.TokenizeRequest, await read_json(request))
        check_model(ctx, req.model, app.state.engine.model)
        if req.prompt is None and req.messages is None:
            raise APIError(400, "give prompt or messages", "invalid_value", "prompt")
        if req.messages is not None:
            P.check_text_parts(req.messages)
            ids = await ctx.run_for(request, serving.chat_prompt, ctx, req)
        else:
            tokenizer = ctx.need_tokenizer("tokenize")
            check_chars([req.prompt], ctx.max_prompt_chars, ctx.max_prompt_tokens)
            ids = await ctx.run_for(request, lambda: tokenizer.encode(req.prompt,
                                                                      add_special_tokens=req.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": app.state.engine.info.max_model_len}

    @app.post("/detokenize", response_model=R.DetokenizeResponse, responses=_ERRORS,
              openapi_extra=_body_schema(P.DetokenizeRequest))
    async def detokenize(request: Request):
        ctx = serving_context(app)
        req = parse_model(P.DetokenizeRequest, await read_json(request))
        check_model(ctx, req.model, app.state.engine.model)
        cap = app.state.settings.max_detokenize_tokens
        if len(req.tokens) > cap:
            raise APIError(400, f"tokens: at most {cap} token ids on this server", "invalid_value", "tokens")
        if req.tokens and max(req.tokens) >= ctx.limits.vocab_size:
            raise APIError(400, f"tokens: token ids must be in [0, {ctx.limits.vocab_size})", "invalid_value",
                           "tokens")
        return {"prompt": await ctx.run_for(request, ctx.need_tokenizer("detokenize").decode, req.tokens)}


def _add_ops_routes(app: FastAPI, aengine: EngineClient) -> None:
    def status_response(ok: bool, detail: str) -> JSONResponse:
        headers = {} if ok else {"Retry-After": str(app.state.settings.retry_after)}
        body = {"status": "ok" if ok else "unavailable", "detail": detail}
        return JSONResponse(body, status_code=200 if ok else 503, headers=headers)

    probe = {"response_model": R.HealthResponse, "responses": {503: {"model": R.HealthResponse}}}

    # HEAD too (load balancers and `curl -I` probe with it); /ping is vLLM's (SageMaker's) name for /health.
    # The first route of a path serves it and names its methods in a 405's Allow; the later GET routes are
    # the schema's entries (a route of two methods would give both one OpenAPI operation id).
    @app.get("/health", **probe)
    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def health():
        return status_response(*aengine.health())

    @app.get("/ready", **probe)
    @app.api_route("/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready():
        return status_response(*aengine.readiness())

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics():
        return Response(aengine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=R.VersionResponse)
    async def version():
        return {"version": __version__}


def _log_request(ctx: serving.ServingContext, rid: str, shown, prompts: list[list[int]]) -> None:
    if ctx.log_requests:
        logger.info("%s prompt: %r", rid, shown)
    else:
        logger.debug("%s: %d prompt(s), %d tokens", rid, len(prompts), sum(map(len, prompts)))


def _body_schema(model: type[BaseModel]) -> dict:
    ref = f"#/components/schemas/{model.__name__}"
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus the hand-parsed request bodies (and the models they reference); token ids get the
    loaded model's vocabulary as their maximum (the schema is cached once the model is loaded)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    engine = app.state.engine.info
    if engine is not None:
        _set_token_id_maximum(components, engine.vocab_size - 1)
        app.openapi_schema = schema
    return schema


def _set_token_id_maximum(node, maximum: int) -> None:
    if isinstance(node, dict):
        if node.pop("x-token-id", False):
            node["maximum"] = maximum
        for value in node.values():
            _set_token_id_maximum(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_token_id_maximum(value, maximum)
