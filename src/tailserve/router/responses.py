"""What the proxy answers with: OpenAI error bodies (JSON or an SSE event), the record of the
backend that accepted a request, the refusal when none did, and the streaming response that
reports its request finished however it ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, StreamingResponse

from tailserve.router.backends import Backend
from tailserve.server.protocol import error_body


def error_response(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def sse_error(message: str, status: int) -> bytes:
    return f"data: {json.dumps(error_body(message, status))}\n\ndata: [DONE]\n\n".encode()


@dataclass(slots=True)
class Attempt:
    """The backend that accepted a request and its open response."""

    backend: Backend
    response: httpx.Response
    tried: set[int]  # backends this request was sent to, this one included
    done: bool = False  # reported finished and the response closed


@dataclass(frozen=True, slots=True)
class Refusal:
    """No response to pass through: the error to answer with, and whether another backend may
    still take the request (it was never accepted)."""

    reason: str
    status: int
    retry: bool = True


class RelayResponse(StreamingResponse):
    """A stream that reports its request finished however it ends — also when the client left
    before the first chunk, when the relay generator never ran (so its ``finally`` did not)."""

    def __init__(
        self, relay: AsyncIterator[bytes], finish: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(relay, **kwargs)
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._finish()


def outcome_of(status: int) -> str:
    if status < 400:
        return "ok"
    return "client_error" if status < 500 else "backend_error"


def forwarded_models(cards: list[dict[str, Any]]) -> dict[str, Any]:
    """``/v1/models`` of several backends as one list: each model id once (the first card)."""
    seen: dict[str, dict[str, Any]] = {}
    for card in cards:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            seen.setdefault(card["id"], card)
    return {"object": "list", "data": list(seen.values())}
