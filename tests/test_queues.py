"""Waiting-queue strategies (core/queues.py): vLLM's FCFS deque and priority heap."""

from __future__ import annotations

import random

import pytest

from tailserve.core.queues import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
    priority_key,
)
from tailserve.core.request import Request


def _req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    r = Request(rid, 4, 2, arrival)
    r.priority = priority
    return r


def _ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_prepends_a_preempted_request_and_removes_keeping_order() -> None:
    q = create_request_queue("fcfs")
    a, b, c, d = (_req(x) for x in "abcd")
    for r in (a, b, c):
        q.add_request(r)
    q.prepend_request(d)
    assert _ids(q) == ["d", "a", "b", "c"] and q.peek_request() is d
    q.remove_requests([a, c])
    assert _ids(q) == ["d", "b"]
    assert q.pop_request() is d and q.preemption_victim([a, b, c]) is c


def test_fcfs_removes_its_head_by_popleft_as_the_one_pass_would() -> None:
    """``remove_requests`` of the queue's first requests, in order, pops them from the head (the
    cost of the admitted, not of the queue); out of order, or with a request not at the head,
    it takes the one pass; both leave what removing each would."""
    rng = random.Random(0)
    for _ in range(200):
        reqs = [_req(str(i)) for i in range(rng.randrange(0, 8))]
        gone = [r for r in reqs[: rng.randrange(0, len(reqs) + 1)]]
        if gone and rng.random() < 0.3:
            gone = rng.sample(reqs, rng.randrange(1, len(reqs) + 1))  # anywhere, any order
        q = FCFSRequestQueue(reqs)
        q.remove_requests(iter(gone))  # any iterable, read once
        assert _ids(q) == [r.request_id for r in reqs if all(r is not g for g in gone)]


def test_fcfs_reorder_takes_only_a_permutation() -> None:
    q = FCFSRequestQueue([_req("a"), _req("b")])
    q.sort(key=lambda r: r.request_id[::-1])
    with pytest.raises(ValueError, match="reorder got 1 requests for a queue of 2"):
        q.reorder([_req("a")])


def test_priority_heap_pops_in_vllm_order_and_requeues_by_key() -> None:
    rng = random.Random(3)
    requests = [_req(f"r{i}", rng.randint(0, 3), float(rng.randint(0, 5))) for i in range(40)]
    q = PriorityRequestQueue()
    for r in requests:
        q.add_request(r)
    expected = sorted(requests, key=priority_key)
    assert _ids(q) == [r.request_id for r in expected]  # iteration is pop order
    head = q.pop_request()
    assert head is expected[0]
    q.prepend_request(head)  # re-enters by its key, not at the front of later arrivals
    assert q.peek_request() is head
    q.remove(expected[5])
    assert len(q) == 39 and expected[5] not in list(q)
    popped = [q.pop_request() for _ in range(len(q))]
    assert popped == [r for r in expected if r is not expected[5]]
    with pytest.raises(IndexError):
        q.pop_request()


def test_priority_victim_is_the_least_urgent_then_latest() -> None:
    running = [_req("a", 0, 1.0), _req("b", 2, 0.0), _req("c", 2, 3.0), _req("d", 1, 9.0)]
    assert PriorityRequestQueue.preemption_victim(running).request_id == "c"


def test_unknown_scheduling_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'; known: fcfs, priority"):
        create_request_queue("lifo")
