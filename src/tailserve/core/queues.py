"""Waiting-queue strategies, as vLLM V1's ``create_request_queue`` (``v1/core/sched/request_queue.py``).

The scheduler owns its waiting queue; a policy picks the strategy (``Policy.create_waiting_queue``)
and then adds, peeks, pops and re-queues through the names vLLM uses:

- ``FCFSRequestQueue``: arrival order; a preempted request goes back to the *front*
  (``prepend_request``). A ``deque`` underneath, as vLLM's, so the FIFO operations cost what a
  deque costs; engines that reorder their queue (SGLang's ``calc_priority``, vLLM V0's priority
  sort) do it through ``reorder`` / ``sort``.
- ``PriorityRequestQueue``: a heap on ``(priority, arrival_time, request_id)``, lower first;
  ``prepend_request`` is a plain push by key (vLLM: a preempted request re-enters by its
  priority, not at the front). Iteration yields requests in key order.

Both name the request an order would preempt first (``preemption_victim``): vLLM V1 preempts the
most recently admitted running request under FCFS and the least urgent (largest
``(priority, arrival_time)``) under priority.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tailserve.core.request import Request


class FCFSRequestQueue(deque):
    """First come, first served; every ``deque`` operation stays available."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        """Back to the front (a request preempted by recompute under FCFS)."""
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove several requests at once, keeping the others' order: the queue's first ones in
        order (an admission walk from the head, SGLang's) by ``popleft``, so the cost follows the
        requests admitted and not the queue's length; any others in one pass over the queue."""
        requests = list(requests)
        if len(requests) <= len(self) and all(self[i] is r for i, r in enumerate(requests)):
            for _ in requests:
                self.popleft()
            return
        gone = {id(r) for r in requests}
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)

    def reorder(self, ordered: list[Request]) -> None:
        """Replace the order with ``ordered``, a permutation of the queue (an engine's sort)."""
        if len(ordered) != len(self):
            raise ValueError(f"reorder got {len(ordered)} requests for a queue of {len(self)}")
        self.clear()
        self.extend(ordered)

    def sort(self, key: Callable[[Request], Any]) -> None:
        """Stable sort by ``key`` (vLLM V0 sorts its waiting deque by (priority, arrival))."""
        self.reorder(sorted(self, key=key))

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        """The most recently admitted running request."""
        return running[-1]


def priority_key(request: Request) -> tuple[int, float, str]:
    """vLLM's priority order: lower ``priority`` first, then earlier arrival, then request id."""
    return (request.priority, request.arrival_time, request.request_id)


class PriorityRequestQueue:
    """A heap on ``priority_key``; keys are unique (request ids are), so the order is total."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    def prepend_request(self, request: Request) -> None:
        """A preempted request re-enters by its key, as any other (vLLM's heap push)."""
        self.add_request(request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][1]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove(self, request: Request) -> None:
        """``list.remove``'s name, so generic code (``Scheduler.abort_request``) can use either queue."""
        self.remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        before = len(self._heap)
        self._heap = [e for e in self._heap if id(e[1]) not in gone]
        if len(self._heap) == before and gone:
            raise ValueError("request not in the queue")
        heapq.heapify(self._heap)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        """The least urgent running request: the largest (priority, arrival time)."""
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in key order (the order ``pop_request`` would return them)."""
        return (request for _, request in sorted(self._heap, key=lambda e: e[0]))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for a ``scheduling_policy`` value: ``fcfs`` or ``priority``."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; known: fcfs, priority")
