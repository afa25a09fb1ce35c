"""One request's response: SSE chunks while it streams, or one JSON object when it is done.

Streaming sends one chunk per engine output that carries tokens (so a client's inter-chunk gaps
are inter-token gaps, as ``vllm bench serve`` assumes), the finish reason on the last one, then
the ``usage`` chunk (``choices: []``) when ``stream_options.include_usage`` is set, then
``data: [DONE]``. A chat stream puts ``role`` in its first content chunk rather than in an empty
chunk of its own: clients time the first token from the first chunk with choices, and an empty
chunk would make TTFT the time to accept the request.

Under a ``stream_interval`` above 1 (the policy's, ``core/stream_interval.py``, as a request's own
value changes it) outputs the rule holds back send nothing; the next chunk that leaves carries
their text with its own, as vLLM's output processor sends every unsent token at once.

When the request is aborted (server shutting down: 503), its engine step failed (500) or the
engine dies mid-stream (503), the stream ends with an ``{"error": ...}`` event saying why, then
``[DONE]``; a plain request gets that error as its response. Whenever the response ends
before the request finished — the client disconnected, or the handler was cancelled — the
request is aborted in the engine, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request

from tailserve.core.stream_interval import Chunker, StreamInterval
from tailserve.llm import RequestOutput
from tailserve.server.async_engine import AsyncEngine
from tailserve.server.protocol import ApiError, error_body, now_s, usage
from tailserve.server.request_stream import Aborted, EngineDeadError, Failed, RequestStream

Kind = Literal["completion", "chat"]


@dataclass(slots=True)
class ResponseMeta:
    kind: Kind
    response_id: str
    model: str
    include_usage: bool = False
    continuous_usage: bool = False
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or now_s()

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion.chunk"

    def chunk(self, text: str, finish_reason: str | None, first: bool, usage_: dict[str, Any] | None) -> dict:
        if self.kind == "completion":
            choice = _completion_choice(text, finish_reason)
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope([choice], usage_)

    def usage_chunk(self, usage_: dict[str, Any]) -> dict:
        return self._envelope([], usage_)

    def _envelope(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict:
        return {
            "id": self.response_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_,
        }

    def final(self, text: str, finish_reason: str | None, usage_: dict[str, Any]) -> dict:
        if self.kind == "completion":
            obj = "text_completion"
            choice = _completion_choice(text, finish_reason)
        else:
            obj = "chat.completion"
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        return {**self._envelope([choice], usage_), "object": obj}


def _usage_of(out: RequestOutput) -> dict[str, Any]:
    return usage(len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens)


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def stream_response(
    engine: AsyncEngine, stream: RequestStream, meta: ResponseMeta, rule: StreamInterval
) -> AsyncIterator[str]:
    """The SSE events of one request (see the module docstring); ``rule`` says which outputs
    send a chunk."""
    last: RequestOutput | None = None
    first = True
    chunker = Chunker(rule)
    held: list[str] = []  # text of the outputs since the last chunk
    try:
        async for item in stream:
            # An abort or a failure ends the stream at once: text held back is dropped, as the
            # client gets an error rather than a completion either way.
            if isinstance(item, Aborted):
                yield _sse(error_body(f"request aborted: {item.reason}", 503))
                break
            if isinstance(item, Failed):
                yield _sse(error_body(item.message, 500))
                break
            last = item
            held.append(item.new_text)
            if not chunker.take(len(item.new_token_ids), finished=item.finished):
                continue
            text = "".join(held)
            held.clear()
            running_usage = _usage_of(item) if meta.continuous_usage else None
            reason = item.finish_reason if item.finished else None
            yield _sse(meta.chunk(text, reason, first, running_usage))
            first = False
        else:
            if meta.include_usage and last is not None:
                yield _sse(meta.usage_chunk(_usage_of(last)))
    except EngineDeadError as error:
        yield _sse(error_body(str(error), 503))
    finally:
        if not stream.finished:
            engine.abort(stream.request_id, "client disconnected")
    yield _sse("[DONE]")


async def full_response(engine: AsyncEngine, stream: RequestStream, meta: ResponseMeta) -> dict[str, Any]:
    """The whole response of one request; raises ``ApiError`` (503) if it was aborted."""
    last: RequestOutput | None = None
    try:
        async for item in stream:
            if isinstance(item, Aborted):
                raise ApiError(f"request aborted: {item.reason}", status=503)
            if isinstance(item, Failed):
                raise ApiError(item.message, status=500)
            last = item
    except EngineDeadError as error:
        raise ApiError(str(error), status=503) from None
    finally:
        if not stream.finished:
            engine.abort(stream.request_id, "client disconnected")
    assert last is not None and last.finished
    return meta.final(last.text, last.finish_reason, _usage_of(last))


async def cancel_on_disconnect(request: Request, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work`` until it returns or the client disconnects (then cancel it): a plain JSON
    response has no stream whose failed write would tell us the client left."""
    task = asyncio.ensure_future(work())

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return None  # the client left; there is no one to answer
        raise
    finally:
        watcher.cancel()


def _completion_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    """One ``/v1/completions`` choice, streamed or whole (the same shape in both)."""
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
