"""Pure ASGI middleware: API-key check and body-size limit, both before any route code runs."""
from __future__ import annotations

import hmac

from server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ping", "/ready", "/metrics", "/version"})
MAX_HEADER_BYTES = 32 * 1024


async def _send_error(send, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


class APIKeyMiddleware:
    """With a key set, every path except OPEN_PATHS needs `Authorization: Bearer KEY` (or `x-api-key`)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            error = APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                             "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await _send_error(send, error)
        return await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        given = token.strip() if scheme.lower() == b"bearer" else (_header(scope, b"x-api-key") or b"")
        # compare_digest: the time taken does not depend on where the first differing byte is
        return hmac.compare_digest(given, self._key)


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: from Content-Length up front, else counted as chunks stream in.
    Also 431 for request headers over MAX_HEADER_BYTES in all (the HTTP server alone may let them through)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) for k, v in scope.get("headers", ())) > MAX_HEADER_BYTES:
            return await _send_error(send, APIError(431, f"request headers are larger than {MAX_HEADER_BYTES} "
                                                         "bytes", "request_header_fields_too_large"))
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, self._error())
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_error(send, self._error())

    def _error(self) -> APIError:
        return APIError(413, f"request body is larger than {self.limit} bytes", "request_too_large")
