"""Forwarding one request: choose a backend, send, pass the answer through, retry what was never
accepted, and answer every failure with an OpenAI error naming the backend.

When a request counts as accepted: once the backend has sent its response head with a status
other than 503. Before that nothing of it is lost by trying elsewhere (an LLM request has no
side effect, and a backend that failed before answering has dropped it), so the request goes to
the next backend the router picks, each backend at most once:

- connection refused or timed out: the backend is taken out (``BackendPool.mark_down``) and
  the request retried;
- the connection broken before a response head (the backend died with the request, or a stale
  keep-alive connection): retried, and the next health check decides about the backend. A
  plain (non-streaming) request gets its head only when it is done, so one whose backend dies
  mid-generation is rerun elsewhere: the client sees a longer request, not an error;
- a 503 (the backend's queue is full, it is shutting down, its engine died): retried, the
  backend stays in (its health check decides).

After acceptance the answer is passed through as it comes: SSE bytes chunk by chunk as they
arrive (no buffering, so a client's token timing is the backend's), a plain body whole, the
status and ``content-type`` as the backend sent them (a 400 stays the backend's 400). A failure
after acceptance cannot be retried without repeating tokens the client already has:

- the backend disconnects before a stream's first byte (the request was still waiting in its
  queue): the client has nothing yet, so the stream goes on from another backend;
- the backend disconnects mid-response: a stream ends with ``data: {"error": {... "code": 502}}``
  and ``data: [DONE]``; a plain request cut inside its body gets that 502;
- no byte for ``read_timeout`` seconds: the same with 504;
- no backend left to try: 503 ("no backend accepted the request: ...").

Every request routed is reported to the router exactly once as finished (``on_finished``), on
every path, so its in-flight counts stay true. ``X-Request-Id`` is forwarded (set when the
client sent none) and returned; the body goes through byte for byte, ``user`` and every other
field included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response

from tailserve.cluster.routing import NoHealthyReplicaError, Router, RouteRequest
from tailserve.router.backends import Backend, BackendPool
from tailserve.router.metrics import RouterMetrics
from tailserve.router.recording import RequestWatch, record_plain, watched
from tailserve.router.responses import Attempt, Refusal, RelayResponse, error_response, outcome_of, sse_error
from tailserve.router.route_keys import route_request
from tailserve.server.serving import cancel_on_disconnect
from tailserve.workloads.recorded import TraceRecorder

logger = logging.getLogger("tailserve.router")

# Not forwarded: hop-by-hop headers and those httpx sets for the new connection.
DROPPED_HEADERS = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "proxy-connection", "accept-encoding"}
)  # fmt: skip
# Connection-level failures before a response head: the backend did not take the request.
NOT_ACCEPTED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.WriteTimeout,
                httpx.RemoteProtocolError, httpx.ReadError, httpx.PoolTimeout)  # fmt: skip


class Proxy:
    def __init__(
        self,
        pool: BackendPool,
        router: Router,
        metrics: RouterMetrics,
        *,
        read_timeout: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        recorder: TraceRecorder | None = None,
    ) -> None:
        if not read_timeout > 0:
            raise ValueError(f"--read-timeout must be > 0 seconds, got {read_timeout}")
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.read_timeout = read_timeout  # seconds without a byte from the backend
        self.clock = clock
        self.policy = router.describe()
        self.recorder = recorder  # --record-trace: each request as a line of a recorded trace

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            self.metrics.rejected.labels("bad_request").inc()
            return error_response("request body is not a JSON object", 400)
        watch = None
        if self.recorder is not None:
            watch = RequestWatch.of(body, self.recorder.arrived(), self.clock())
        request_id = request.headers.get("x-request-id") or f"router-{uuid.uuid4().hex}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        headers["x-request-id"] = request_id
        # The router tracks requests by its own id: clients may reuse theirs.
        routed = route_request(path, body, uuid.uuid4().hex, request.headers)
        if body.get("stream") is True:
            return await self._forward(path, raw, headers, routed, request_id, watch)
        # A plain answer has no stream whose failed write would show that the client left.
        result = await cancel_on_disconnect(
            request, lambda: self._forward(path, raw, headers, routed, request_id, watch)
        )
        return result if result is not None else Response(status_code=499)

    async def _forward(
        self,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        routed: RouteRequest,
        request_id: str,
        watch: RequestWatch | None = None,
    ) -> Response:
        reply_headers = {"x-request-id": request_id}
        attempt = await self._send(path, raw, headers, routed)
        if isinstance(attempt, Refusal):
            if attempt.status == 503:
                self.metrics.rejected.labels("no_backend").inc()
            if watch is not None and self.recorder is not None:
                watch.error = attempt.reason
                record_plain(watch, b"", attempt.status, self.recorder, self.clock())
            return error_response(attempt.reason, attempt.status, reply_headers)
        reply_headers["x-tailserve-backend"] = attempt.backend.url
        if attempt.response.headers.get("content-type", "").startswith("text/event-stream"):
            relay = self._relay(attempt, routed, path, raw, headers)
            if watch is not None and self.recorder is not None:
                relay = watched(relay, watch, self.recorder, attempt.response.status_code, self.clock)
            return RelayResponse(
                relay,
                lambda: self._finish(attempt, routed, "cancelled"),
                status_code=attempt.response.status_code,
                media_type="text/event-stream",
                headers=reply_headers,
            )
        response = await self._read_whole(attempt, routed, reply_headers)
        if watch is not None and self.recorder is not None:
            record_plain(watch, bytes(response.body), response.status_code, self.recorder, self.clock())
        return response

    async def _send(
        self,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        routed: RouteRequest,
        tried: set[int] | None = None,
    ) -> Attempt | Refusal:
        """The first backend to accept, trying each at most once (``tried`` ones not again);
        else the error to answer."""
        tried = set() if tried is None else tried
        failures: list[str] = []
        while len(tried) < len(self.pool.backends):
            try:
                index = self.router.route(routed, self.pool.states(exclude=tried), self.clock())
            except NoHealthyReplicaError:
                break
            backend = self.pool.backends[index]
            tried.add(index)
            self.metrics.decisions.labels(self.policy, backend.url).inc()
            self.router.on_routed(routed, index, self.clock())
            self._opened(backend)
            try:
                answer = await self._try(backend, path, raw, headers)
            except BaseException:  # cancelled: the client left while the backend had not answered
                self._closed(backend, routed, "cancelled")
                raise
            if isinstance(answer, httpx.Response):
                return Attempt(backend, answer, tried)
            self._closed(backend, routed, None if answer.retry else "backend_error")
            if not answer.retry:
                return answer
            failures.append(f"{backend.url}: {answer.reason}")
            self.metrics.retries.labels(backend.url).inc()
        tried_text = "; ".join(failures) if failures else "no backend is healthy"
        return Refusal(f"no backend accepted the request: {tried_text}", 503)

    async def _try(
        self, backend: Backend, path: str, raw: bytes, headers: dict[str, str]
    ) -> httpx.Response | Refusal:
        """The backend's open response, or why it gave none."""
        client = self.pool.client
        outgoing = client.build_request(
            "POST",
            f"{backend.url}{path}",
            content=raw,
            headers=headers,
            timeout=httpx.Timeout(self.read_timeout, connect=self.pool.probe_timeout),
        )
        try:
            response = await client.send(outgoing, stream=True)
        except httpx.ReadTimeout:
            # It took the request and has not answered (a plain request answers when it is
            # done): it may be working on it, so another backend would not be faster.
            self.metrics.errors.labels(backend.url, "timeout").inc()
            message = f"backend {backend.url} did not answer in {self.read_timeout:g} s (--read-timeout)"
            return Refusal(message, 504, retry=False)
        except NOT_ACCEPTED as error:
            self.metrics.errors.labels(backend.url, "connect").inc()
            reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
                # Nothing listens there: out until a health check passes. A connection that
                # broke before the head may have been a stale keep-alive one; the check decides.
                self.pool.mark_down(backend, reason)
            return Refusal(reason, 503)
        if response.status_code == 503:
            try:
                detail = (await response.aread()).decode("utf-8", "replace")
                message = json.loads(detail)["error"]["message"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                message = "503 Service Unavailable"
            finally:
                await response.aclose()
            self.metrics.errors.labels(backend.url, "unavailable").inc()
            return Refusal(f"503 {message}", 503)
        return response

    async def _relay(
        self, attempt: Attempt, routed: RouteRequest, path: str, raw: bytes, headers: dict[str, str]
    ) -> AsyncIterator[bytes]:
        """The backend's SSE bytes as they arrive. A backend that fails before any byte reached
        the client (the request was still waiting there) hands it on to another backend; one
        that fails later ends the stream with an error event."""
        sent_any = False
        at_boundary = True  # the bytes sent so far end between two events
        while True:
            backend, response = attempt.backend, attempt.response
            outcome = "backend_error"
            lost = ""  # why the backend failed before the first byte: try another
            try:
                async for chunk in response.aiter_bytes():  # decoded if it was compressed
                    at_boundary = chunk.endswith(b"\n\n")
                    sent_any = sent_any or bool(chunk)
                    yield chunk
                outcome = outcome_of(response.status_code)
                return
            except httpx.ReadTimeout:
                self.metrics.errors.labels(backend.url, "timeout").inc()
                message = f"backend {backend.url} sent nothing for {self.read_timeout:g} s (--read-timeout)"
                yield (b"" if at_boundary else b"\n\n") + sse_error(message, 504)
                return
            except httpx.HTTPError as error:
                self.metrics.errors.labels(backend.url, "disconnect").inc()
                self.pool.mark_down(backend, f"failed mid-response ({type(error).__name__})")
                lost = f"backend {backend.url} failed mid-response ({type(error).__name__})"
                if sent_any:
                    yield (b"" if at_boundary else b"\n\n") + sse_error(f"{lost}; the request was lost", 502)
                    return
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"  # the client left: closing the response tells the backend
                raise
            finally:
                await self._finish(attempt, routed, outcome)
            self.metrics.retries.labels(backend.url).inc()
            following = await self._send(path, raw, headers, routed, attempt.tried)
            if isinstance(following, Refusal):
                yield sse_error(f"{lost} before its first byte; {following.reason}", 502)
                return
            if not following.response.headers.get("content-type", "").startswith("text/event-stream"):
                status = following.response.status_code
                await self._finish(following, routed, outcome_of(status))
                yield sse_error(
                    f"{lost} before its first byte; {following.backend.url} answered {status}", 502
                )
                return
            attempt = following

    async def _read_whole(self, attempt: Attempt, routed: RouteRequest, headers: dict[str, str]) -> Response:
        backend, response = attempt.backend, attempt.response
        outcome = "backend_error"
        try:
            content = await response.aread()
            outcome = outcome_of(response.status_code)
            media = response.headers.get("content-type")
            return Response(content, status_code=response.status_code, media_type=media, headers=headers)
        except httpx.ReadTimeout:
            self.metrics.errors.labels(backend.url, "timeout").inc()
            message = f"backend {backend.url} sent nothing for {self.read_timeout:g} s (--read-timeout)"
            return error_response(message, 504, headers)
        except httpx.HTTPError as error:
            self.metrics.errors.labels(backend.url, "disconnect").inc()
            self.pool.mark_down(backend, f"failed mid-response ({type(error).__name__})")
            message = (
                f"backend {backend.url} failed mid-response ({type(error).__name__}); the request was lost"
            )
            return error_response(message, 502, headers)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            await self._finish(attempt, routed, outcome)

    async def _finish(self, attempt: Attempt, routed: RouteRequest, outcome: str) -> None:
        """Report the request finished and close the backend's response, once."""
        if attempt.done:
            return
        attempt.done = True
        self._closed(attempt.backend, routed, outcome)
        with anyio.CancelScope(shield=True):  # closing must finish even in a cancelled task
            await attempt.response.aclose()

    def _opened(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)

    def _closed(self, backend: Backend, routed: RouteRequest, outcome: str | None) -> None:
        """The request left ``backend``; ``outcome`` None: it never was accepted there."""
        backend.in_flight -= 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)
        self.router.on_finished(routed.request_id, backend.index, self.clock())
        if outcome is not None:
            self.metrics.requests.labels(backend.url, outcome).inc()
