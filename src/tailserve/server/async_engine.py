"""The engine in its own thread, one async stream per request for the HTTP layer.

``LLMEngine`` is single-threaded and ``step()`` blocks (a forward pass, or the simulated
iteration time slept in real time), so it runs in one thread that owns it outright:

    HTTP handlers (event loop)                    engine thread
    generate() ──── _Add / _Abort / _Stop ────►   inbox  ──► add_request / abort_request
    RequestStream ◄── call_soon_threadsafe ────   step() ──► list[RequestOutput]
    snapshot (queue limit, /health) ◄─────────    stats() after every command batch and step

Everything that touches the engine happens in its thread; the event loop only reads the
published ``EngineSnapshot`` and the per-request queues. A request leaves its stream either
with a finished output, with ``Aborted`` (client gone, server shutting down), or with
``Failed`` (its engine step raised), so no handler waits forever; aborting also frees the
request's KV blocks in the engine.

Faults: a ``StepFailedError`` (the engine aborted that step's requests and checked itself) is
logged with its traceback, those requests end with ``Failed``, and the thread goes on. Anything
else — ``EngineFatalError`` or an unexpected exception — kills the thread: it is logged, every
stream and every request still waiting to be accepted gets ``EngineDeadError``, and
``on_fatal`` is called on the event loop (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tailserve.llm import LLMEngine, RequestOutput, SamplingParams
from tailserve.llm.llm_engine import EngineFatalError, StepFailedError, describe_error
from tailserve.server.prometheus import ServerMetrics
from tailserve.server.request_stream import (
    Aborted,
    EngineDeadError,
    Failed,
    QueueFullError,
    RequestStream,
    ShuttingDownError,
)

if TYPE_CHECKING:
    from tailserve.server.kv_events import ZmqKvEventPublisher

logger = logging.getLogger("tailserve.server")


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the event loop may know of the engine, published by the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction 0..1
    num_added: int = 0  # add commands the engine thread has taken (accepted or refused)
    has_unfinished: bool = False


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    accepted: concurrent.futures.Future[None]
    tenant_id: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str
    reason: str


@dataclass(slots=True)
class _Stop:
    pass


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queued_requests: int | None = None,
        metrics: ServerMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        kv_events: ZmqKvEventPublisher | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        engine.raise_refusals()  # a policy's refusal at arrival is this server's 503 / 429
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.on_fatal = on_fatal  # called on the event loop once the engine thread died
        # KV events (server/kv_events.py): published after each step from the hashed manager
        kv = engine.scheduler.kv_cache
        self.kv_events = kv_events if kv_events is not None and kv.prefix_caching else None
        self._kv_events_from = kv if self.kv_events is not None else None
        if self._kv_events_from is not None:
            self._kv_events_from.take_kv_events()  # start recording
        self.num_failed_steps = 0
        self.snapshot = EngineSnapshot()
        self.dead: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._num_submitted = 0  # loop thread only
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # engine thread only
        self._live: set[str] = set()
        self._num_added = 0
        self._stopping = False

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tailserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_queued(self) -> int:
        """Requests waiting for the engine: sent to its thread but not taken yet, plus its waiting queue."""
        s = self.snapshot
        return self._num_submitted - s.num_added + s.num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def dead_message(self) -> str:
        error = self.dead
        if isinstance(error, EngineFatalError) and error.__cause__ is not None:
            error = error.__cause__  # name what went wrong, not the wrapper
        what = type(error).__name__ if error is not None else "unknown"
        return f"the engine stopped after an internal error ({what}); see the server log"

    @property
    def is_healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_id: str | None = None,
        tenant_id: str | None = None,
    ) -> RequestStream:
        """Add a request and return its stream once the engine has accepted it.

        Raises the engine's ``ValueError`` for bad input, ``QueueFullError`` when the waiting
        queue is at ``max_queued_requests``, ``ShuttingDownError`` while draining and
        ``EngineDeadError`` after an engine failure.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead_message)
        if not self._accepting or self._thread is None:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        limit = self.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            raise QueueFullError(
                f"the waiting queue is full: {self.num_queued} requests are waiting "
                f"(--max-queued-requests {limit}); retry later"
            )
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._num_submitted += 1
        self._inbox.put(_Add(request_id, prompt, params, priority, accepted, tenant_id))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            # Refused by the engine, or the client left while we waited: nothing may linger.
            self._streams.pop(request_id, None)
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not refused:
                self.abort(request_id, "client disconnected")
            raise
        return stream

    def abort(self, request_id: str, reason: str) -> None:
        """Abort a request (no-op once it finished); its stream ends with ``Aborted(reason)``."""
        self._inbox.put(_Abort(request_id, reason))

    async def drain(self, timeout: float, reason: str = "server shutting down") -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` seconds, then
        abort the rest with ``reason``."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.dead is None:
            await asyncio.sleep(0.02)
        for request_id in list(self._streams):
            self.abort(request_id, reason)
        # Let the aborts reach their streams so handlers can send the reason.
        while self._streams and self.dead is None and time.monotonic() < deadline + 5.0:
            await asyncio.sleep(0.01)

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Drain (see ``drain``), then stop and join the engine thread."""
        await self.drain(timeout)
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 10.0)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._queue.put_nowait(output)
            if output.finished:
                del self._streams[output.request_id]

    def _deliver_abort(self, request_id: str, reason: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._queue.put_nowait(Aborted(reason))

    def _deliver_failure(self, request_ids: list[str], message: str) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._queue.put_nowait(Failed(message))

    def _fail_all(self, error: BaseException) -> None:
        """On the event loop after the engine thread died: answer every stream and every request
        still waiting to be accepted, then tell the owner."""
        message = self.dead_message
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._queue.put_nowait(EngineDeadError(message))
        # generate() runs on this loop and checks ``dead`` first, so nothing is added after this.
        self._refuse_waiting(message)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _refuse_waiting(self, message: str) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(EngineDeadError(message))

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if self._stopping and not busy:
                    break
                for command in self._take_commands(block=not busy):
                    self._apply(command)
                self._publish()
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except StepFailedError as failure:
                        self._on_step_failed(failure)
                        continue
                    for output in outputs:
                        if output.finished:
                            self._live.discard(output.request_id)
                    # Figures before delivery: a client that scrapes /metrics right after a
                    # request's last byte finds that request in the histograms.
                    if self.metrics is not None:
                        self.metrics.observe_outputs(outputs)
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
                    if self._kv_events_from is not None:
                        self.kv_events.publish(self._kv_events_from.take_kv_events())  # type: ignore[union-attr]
                    self._publish()
        except BaseException as error:  # the engine is unusable now; tell every waiter why
            logger.critical(
                "engine thread died, the server will exit: %s", describe_error(error), exc_info=error
            )
            self.dead = error
            self._refuse_waiting(self.dead_message)
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _on_step_failed(self, failure: StepFailedError) -> None:
        assert self._loop is not None
        self.num_failed_steps += 1
        logger.error(
            "engine step failed, %d requests answered with a 500, engine consistent, going on: %s",
            len(failure.request_ids),
            describe_error(failure.cause),
            exc_info=failure.cause,
        )
        for request_id in failure.request_ids:
            self._live.discard(request_id)
        if self.metrics is not None:
            self.metrics.observe_failed(len(failure.request_ids))
        message = f"{failure.reason}; see the server log"
        self._loop.call_soon_threadsafe(self._deliver_failure, failure.request_ids, message)
        self._publish()

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _Stop]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | _Stop) -> None:
        assert self._loop is not None
        if isinstance(command, _Add):
            self._num_added += 1
            if not command.accepted.set_running_or_notify_cancel():
                return  # the client left before the engine saw the request
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    priority=command.priority,
                    tenant_id=command.tenant_id,
                )
            except Exception as error:  # ValueError for bad input; anything else is reported as is
                command.accepted.set_exception(error)
                return
            self._live.add(command.request_id)
            command.accepted.set_result(None)
        elif isinstance(command, _Abort):
            if command.request_id in self._live:
                self._live.discard(command.request_id)
                self.engine.abort_request(command.request_id, command.reason)
                if self.metrics is not None:
                    self.metrics.observe_abort()
            self._loop.call_soon_threadsafe(self._deliver_abort, command.request_id, command.reason)
        else:
            self._stopping = True
            for request_id in list(self._live):
                self._apply(_Abort(request_id, "server shutting down"))

    def _publish(self) -> None:
        stats = self.engine.stats()
        self.snapshot = EngineSnapshot(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            num_added=self._num_added,
            has_unfinished=self.engine.has_unfinished_requests(),
        )
        if self.metrics is not None:
            self.metrics.observe_stats(stats)
