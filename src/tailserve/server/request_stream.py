"""One request's outputs as the HTTP layer consumes them, and the errors that end a request early.

A ``RequestStream`` yields the engine's ``RequestOutput``s in order and stops after the finished
one, or after ``Aborted`` (with the reason) when the request was aborted, or after ``Failed``
when the engine step that ran it raised; an exception put on it (``EngineDeadError``) is raised
to the consumer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tailserve.llm import RequestOutput


class QueueFullError(RuntimeError):
    """The waiting queue holds ``--max-queued-requests`` requests already."""


class ShuttingDownError(RuntimeError):
    """The server is draining and takes no new requests."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an unexpected error."""


@dataclass(frozen=True, slots=True)
class Aborted:
    """The last item of a stream whose request was aborted, with the reason."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The last item of a stream whose request was in an engine step that raised (a 500)."""

    message: str


@dataclass(slots=True)
class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished one."""

    request_id: str
    _queue: asyncio.Queue[RequestOutput | Aborted | Failed | BaseException] = field(
        default_factory=asyncio.Queue
    )
    finished: bool = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput | Aborted | Failed]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if isinstance(item, (Aborted, Failed)) or item.finished:
                self.finished = True
            yield item
