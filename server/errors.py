"""OpenAI-shaped errors: every error body is {"error": {"message", "type", "param", "code"}}.

Codes the server sends (status: code):
  400 invalid_json (malformed JSON, invalid UTF-8, NaN/Infinity, a body that is not an object),
      invalid_type, invalid_value, missing_required_parameter, context_length_exceeded, unsupported
  401 invalid_api_key          404 model_not_found, not_found          405 method_not_allowed (+ Allow)
  408 timeout (queue or total deadline passed)                          413 request_too_large
  415 unsupported_media_type   429 overloaded (+ Retry-After)  431 request_header_fields_too_large
  500 internal_error (a failed model step, a bug)                       503 not_ready, shutting_down, engine_dead
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvserve.server")

MAX_MESSAGE_CHARS = 300  # errors never echo a whole (possibly huge) input back
MAX_PARAM_CHARS = 100  # a param names a field, but its path may hold input (a logit_bias key)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          431: "invalid_request_error",
          429: "rate_limit_error"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}

# Union-typed fields: pydantic reports one error per union member; one plain sentence reads better.
_UNION_MESSAGES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = truncate(message)
        self.code = code
        self.param = None if param is None else truncate(param, MAX_PARAM_CHARS)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "...(truncated)"


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    param = None if param is None else truncate(param, MAX_PARAM_CHARS)
    return {"error": {"message": truncate(message), "type": error_type(status), "param": param, "code": code}}


def from_validation_errors(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400, naming the field and never quoting the input."""
    err = errors[0]
    same_field = [e for e in errors if e.get("loc", ())[:1] == err.get("loc", ())[:1]]
    # In a union, a value error comes from the member whose type matched: it is the one that explains.
    err = next((e for e in same_field if _validation_code(e.get("type", "")) == "invalid_value"), err)
    loc = _loc(err)
    kind = err.get("type", "")
    union = _union_path(loc)
    members = [e for e in errors if union and _loc(e)[:len(union)] == union]
    if len(members) > 1 and _validation_code(kind) == "invalid_type":
        param = ".".join(union)
        message, code = f"{param}: {_UNION_MESSAGES[union[-1]]}", "invalid_type"
    else:
        param = ".".join(p for p in loc if "[" not in p) or None
        message = f"{param}: {err.get('msg', 'invalid')}" if param else err.get("msg", "invalid request")
        code = _validation_code(kind)
    return APIError(400, message, code, param)


def _loc(err: dict) -> list[str]:
    return [str(p) for p in err.get("loc", ()) if p != "body"]


def _union_path(loc: list[str]) -> list[str]:
    """The location up to its last field with a union message (messages.0.content, prompt), or []."""
    last = next((i for i in range(len(loc) - 1, -1, -1) if loc[i] in _UNION_MESSAGES), None)
    return [] if last is None else loc[:last + 1]


def _validation_code(kind: str) -> str:
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("is_instance_of", "union_tag_invalid",
                                                                       "literal_error", "model_attributes_type"):
        return "invalid_type"
    return "invalid_value"


def install_handlers(app: FastAPI) -> None:
    """Replace every FastAPI / Starlette default error body with the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_errors(exc.errors(include_input=False)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = "no such route"
        return APIError(exc.status_code, message, code, headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error: %s", type(exc).__name__, exc_info=exc)
        return APIError(500, "internal server error", "internal_error").response()
