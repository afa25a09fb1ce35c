"""ASGI middleware in front of the routes: an API key, a request-body limit, admission, the request id.

- ``ApiKeyGuard``: with ``--api-key`` (or ``TAILSERVE_API_KEY`` / ``VLLM_API_KEY``) every route but
  ``/health``, ``/metrics`` and ``/version`` needs ``Authorization: Bearer <key>``, as vLLM guards
  its ``/v1`` routes; a missing or wrong key is a 401 in OpenAI's error shape. CORS preflight
  (``OPTIONS``) passes, as in vLLM.
- ``BodyLimit``: a body over ``max_bytes`` is a 413 before the handler runs: a declared
  ``Content-Length`` is refused without reading a byte, a chunked body as soon as it crosses the
  limit. The body is read here (at most ``max_bytes``) and replayed to the app; a client that
  leaves (or is timed out, ``launch.ClientTimeoutProtocol``) before its body is complete never
  reaches the app.
- ``ConcurrencyLimit``: at most ``limit`` requests in flight, each from its request head to the
  end of its response (a stream's last event); one more gets a 503 in OpenAI's error shape at once,
  with ``Retry-After``, and the rest of a burst is served. ``GET``s of ``/health``, ``/metrics``
  and ``/version`` without a body are never refused: a monitor must see an overloaded server.
  (uvicorn's own ``limit_concurrency`` counted open connections too and answered plain text, so a
  burst just past it was refused whole.)
- ``RequestIdHeader``: the client's (or a router's) ``X-Request-Id``, else a fresh uuid, is the
  request's id (``request.state.request_id``: the completion routes build ``cmpl-<id>`` /
  ``chatcmpl-<id>`` from it, as vLLM's ``_base_request_id`` does) and comes back in the
  response's ``X-Request-Id`` header on every response, errors included (vLLM echoes it with
  ``--enable-request-id-headers``; here always).
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tailserve.server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
MAX_REQUEST_ID_LEN = 256  # characters of X-Request-Id: an id, not a payload
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # 4 MiB: far above any prompt a context holds, below a stall
DEFAULT_LIMIT_CONCURRENCY = 1024  # requests in flight


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class ApiKeyGuard:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        if not api_keys or any(not key for key in api_keys):
            raise ValueError("--api-key must not be empty")
        self.app = app
        self._keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await send_error(
                send,
                401,
                "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.",
                {"www-authenticate": "Bearer"},
            )
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                # compare_digest against every key: no timing hint of which prefix matched
                return scheme.lower() == b"bearer" and any(
                    secrets.compare_digest(token, key) for key in self._keys
                )
        return False


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"--max-request-bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return (
            f"request body is larger than the server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(send, 413, self._too_large())
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left (or timed out) before sending it all: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, 413, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                replay: list[Message] = [
                    {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                ]
                break

        async def replayed() -> Message:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)


class ConcurrencyLimit:
    def __init__(self, app: ASGIApp, limit: int, retry_after_s: int = 1) -> None:
        if limit < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {limit}")
        self.app = app
        self.limit = limit
        self.retry_after = str(retry_after_s)
        self.in_flight = 0  # requests admitted and not answered yet
        self.shed = 0  # requests refused since the start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _monitoring(scope):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            self.shed += 1
            message = (
                f"the server is at its limit of {self.limit} concurrent requests (--limit-concurrency); "
                "retry later"
            )
            await send_error(send, 503, message, {"retry-after": self.retry_after})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _monitoring(scope: Scope) -> bool:
    """A GET (or HEAD) of a monitoring route without a body: cheap whatever the load."""
    if scope["method"] not in ("GET", "HEAD") or scope["path"] not in OPEN_PATHS:
        return False
    return not any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
        for name, value in scope["headers"]
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def cors_options(origins: list[str]) -> dict[str, Any]:
    """Starlette ``CORSMiddleware`` options for ``--allowed-origins`` (vLLM's defaults otherwise)."""
    return {
        "allow_origins": origins,
        "allow_credentials": False,
        "allow_methods": ["*"],
        "allow_headers": ["*"],
    }


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if given is not None and not 0 < len(given) <= MAX_REQUEST_ID_LEN:
            await send_error(send, 400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LEN} characters long")
            return
        raw = given if given is not None else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = raw.decode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", raw)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
