"""vLLM 0.32's API-server admission limits: ``max_num_queued_reqs`` and ``max_num_queued_tokens``.

Followed from vLLM 0.32 (``AsyncLLM.check_admission``, ``vllm/v1/engine/async_llm.py:316-370``;
the fields and their docs in ``vllm/config/scheduler.py:92-132``). The API server checks every
request before it reaches the engine and answers HTTP 503 when

- ``max_num_queued_reqs``: its unfinished requests (every request it has not seen finish: waiting
  and running, ``OutputProcessor.get_num_unfinished_requests``) plus this one exceed the limit
  (``QueueOverflowError``);
- ``max_num_queued_tokens``: the prompt tokens of its requests still *prefilling* reach the limit
  (``>=``; the incoming prompt is not added: ``MaxQueuedTokensError``). A request stops
  prefilling in the API server's view when its first output reaches the output processor
  (``output_processor.py:733-743``), i.e. at its first token; a later preemption does not make it
  prefilling again, and chunked-prefill progress and prefix-cache hits are not subtracted (the
  engine does not report them before the first token).

Here the policy's ``add_request`` asks ``Admission.refusal`` and refuses with ``sched.reject``
(status ``FINISHED_REJECTED``, the reason vLLM's 503 message with the numbers). The costs, per
arrival and not per queued request: the unfinished count is the scheduler's queue lengths (its
waiting, running, loading and swapped requests: every request accepted and not yet left); the
prefilling tokens are a counter, added on acceptance and taken off when the request leaves
(``left``, the policy's ``on_finished``: finished, aborted) or is found to have sampled. Only a
request admitted to run can sample, so the policy hands each pass's admissions over
(``started``), and ``refusal`` looks at those alone, and only when the counter reaches the limit
(``settle``): each such request is dropped once it has its first token, however that token was
produced (a stepped iteration or a simulator's decode run, which admit nobody and stop before an
arrival), so an arrival costs the in-progress prefills at most.

vLLM's ``QueueOverflowError`` / ``MaxQueuedTokensError`` messages (``vllm/exceptions.py:156-184``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler

QUEUE_OVERFLOW = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
MAX_QUEUED_TOKENS = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)


@dataclass(slots=True)
class Admission:
    """The counters one vLLM API server keeps for its two limits (None: no limit)."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # Prompt tokens of the accepted requests counted as prefilling (an upper bound between
    # ``settle`` calls: some of ``_started`` may have sampled since).
    queued_tokens: int = 0
    # The requests counted in ``queued_tokens`` (insertion-ordered, keyed by identity).
    _counted: dict[Request, None] = field(default_factory=dict)
    # Of them, those admitted to run at least once: the only ones that may have sampled.
    _started: dict[Request, None] = field(default_factory=dict)
    num_refused_reqs: int = 0  # refused by max_num_queued_reqs
    num_refused_tokens: int = 0  # refused by max_num_queued_tokens
    # A data-parallel engine's ranks behind the one API server (``share``): their schedulers,
    # whose requests the unfinished count covers; None: the scheduler asked about alone.
    ranks: list[Scheduler] | None = None

    def share(self, ranks: list[Scheduler]) -> None:
        """Make this the one API server of a DP engine's ranks (``cluster/dp_group.py``, which
        hands it to every rank's policy): vLLM checks both limits in the API server, over every
        rank it routes to (``vllm/config/scheduler.py:97-101, 116-119@v0.32.0``)."""
        self.ranks = ranks

    def refusal(self, sched: Scheduler, request: Request) -> str | None:
        """vLLM's 503 message (with the numbers) if ``request`` is refused now, else None."""
        limit = self.max_num_queued_reqs
        if limit is not None:
            unfinished = 0
            for s in self.ranks or (sched,):
                unfinished += len(s.waiting) + len(s.running) + len(s.loading) + len(s.swapped)
            if unfinished + 1 > limit:
                self.num_refused_reqs += 1
                return f"{QUEUE_OVERFLOW} (max_num_queued_reqs={limit}: {unfinished} requests unfinished)"
        limit = self.max_num_queued_tokens
        if limit is not None:
            if self.queued_tokens >= limit:
                self.settle()
            if self.queued_tokens >= limit:
                self.num_refused_tokens += 1
                return (
                    f"{MAX_QUEUED_TOKENS} (max_num_queued_tokens={limit}: "
                    f"{self.queued_tokens} prompt tokens of requests before their first token)"
                )
        return None

    def accept(self, request: Request) -> None:
        """``request`` was queued: its prompt counts until its first token."""
        if self.max_num_queued_tokens is not None:
            self._counted[request] = None
            self.queued_tokens += request.prompt_len

    def started(self, running: list[Request], num_admitted: int) -> None:
        """A pass admitted ``num_admitted`` requests: the last entries of ``running`` (a pass that
        admits preempts nobody, and admission appends)."""
        counted, started = self._counted, self._started
        for request in running[len(running) - num_admitted :]:
            if request in counted:
                started[request] = None

    def settle(self) -> None:
        """Drop the started requests that have sampled (or left) from the count."""
        counted = self._counted
        for request in [r for r in self._started if r.num_output_tokens or r.is_finished]:
            del self._started[request]
            del counted[request]
            self.queued_tokens -= request.prompt_len

    def left(self, finished: list[Request]) -> None:
        """Requests that left (finished, aborted): none counts any more."""
        counted = self._counted
        if not counted:
            return
        for request in finished:
            if request in counted:
                del counted[request]
                self._started.pop(request, None)
                self.queued_tokens -= request.prompt_len

    def prefilling_tokens(self) -> int:
        """The exact count (settled first), for tests and reports."""
        self.settle()
        return self.queued_tokens
