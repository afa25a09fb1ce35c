"""SGLang 0.5.23's priority preemption and the prefill walk around it, hand-worked against the
source (``sglang/srt/managers/schedule_policy.py`` ``PrefillAdder.preempt_to_schedule`` :1707,
``scheduler.py`` ``_get_new_batch_prefill_raw`` :4079). Each rule here was found or confirmed by
the prefill-pass differential (``tests/test_differential_sglang_adder.py``).
"""

from __future__ import annotations

import pytest

from helpers import grants as _grants
from helpers import ids as _ids
from helpers import scheduler_for
from helpers import step as _step
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.policies.sglang import SglangConfig, SglangPolicy


def _sched(num_blocks: int, **cfg) -> Scheduler:
    cfg.setdefault("enable_priority_scheduling", True)
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, 4096)


def _running(
    sched: Scheduler, rid: str, prompt: int, max_tokens: int, priority: int, t: float = 0.0
) -> Request:
    """Decoding, one output generated: ``prompt`` + 1 tokens, ``prompt`` of them in KV."""
    request = Request(rid, prompt, max_tokens, t, priority=priority)
    request.num_output_tokens = 1
    request.num_computed_tokens = prompt
    request.status = RequestStatus.RUNNING
    request.enqueue_time = t
    assert sched.allocate(request, prompt)
    sched.running.append(request)
    return request


def _two_running(num_blocks: int) -> tuple[Scheduler, SglangPolicy]:
    """r1 (priority 0) and r2 (priority 20) decoding, 10 slots each, 59 outputs to come; the
    running cap is reached, so a waiting request can get in only by preemption."""
    sched = _sched(num_blocks, max_running_requests=2)
    _running(sched, "r1", 10, 60, 0)
    _running(sched, "r2", 10, 60, 20)
    return sched, sched.policy


def test_a_request_never_looked_at_asks_room_for_its_outputs_only():
    """``min_tokens_to_remove = len(req.full_untruncated_fill_ids) - req.prefix_len + min(
    max_new_tokens, 4096) - rem_total_tokens`` (:1736), asked before the walk's
    ``init_next_round_input`` fills the ids: for a new request that is 0 + 30 - (80 free - 2 x
    59 x 0.7 reserved) = 32.6, which r1's 41.3 covers. r1 goes; then h's real need (50 + 30 +
    1 = 81) does not fit the 90 - 41.3 left (NO_TOKEN), and r1 is requeued all the same (:4296)."""
    sched, policy = _two_running(100)
    h = Request("h", 50, 30, 1.0, priority=11)
    assert sched.add_request(h, 1.0)
    out = _step(sched, 2.0)
    assert _ids(out.preempted) == ["r1"] and _grants(out) == [("r2", 1, 10)]
    assert _ids(sched.waiting) == ["h", "r1"] and policy.batch_is_full
    # What the walk's look left: h's fill ids and match; r1 keeps the fill of its admission.
    assert policy.sgl_fill_len["h"] == 50 and policy.sgl_prefix_len["h"] == 0


def test_a_request_looked_at_before_asks_room_for_its_whole_fill():
    """The same h, but an earlier walk filled its ids (50 tokens): 50 + 30 - (-2.6) = 82.6 is
    more than r1's 41.3, and r2 is not less urgent by more than the threshold: no preemption."""
    sched, policy = _two_running(100)
    h = Request("h", 50, 30, 1.0, priority=11)
    assert sched.add_request(h, 1.0)
    policy.sgl_fill_len["h"] = 50
    out = _step(sched, 2.0)
    assert not out.preempted and _grants(out) == [("r1", 1, 10), ("r2", 1, 10)]
    assert _ids(sched.waiting) == ["h"]


def test_a_requeued_victim_keeps_its_fill_but_loses_its_prefix():
    """``reset_for_retract`` zeroes ``prefix_len`` and leaves the fill ids as they were."""
    sched, policy = _two_running(100)
    policy.sgl_fill_len["r1"], policy.sgl_prefix_len["r1"] = 10, 4  # from r1's admission
    assert sched.add_request(Request("h", 50, 30, 1.0, priority=11), 1.0)
    _step(sched, 2.0)
    assert policy.sgl_fill_len["r1"] == 10 and "r1" not in policy.sgl_prefix_len


@pytest.mark.parametrize(("low_first", "victims"), [(False, ["b", "c"]), (True, ["a"])])
def test_victims_least_urgent_first_then_most_recent(low_first, victims):
    """Sorted by (priority x -sign, -queue time) (:1724): with higher values more urgent, b and
    c (priority 0) before a; among them c (queued later) first; each victim's reservation comes
    off the need until it is covered. With lower values more urgent only a (5) is less urgent
    than h (2) by more than the threshold 2."""
    sched = _sched(400, max_running_requests=3, schedule_low_priority_values_first=low_first,
                   priority_scheduling_preemption_threshold=2)  # fmt: skip
    _running(sched, "a", 10, 201, 5, t=0.0)
    _running(sched, "b", 10, 201, 0, t=1.0)
    _running(sched, "c", 10, 201, 0, t=2.0)
    # fresh h: need = 200 - (370 free - 3 x 200 x 0.7) = 250; each victim gives 140.
    assert sched.add_request(Request("h", 10, 200, 3.0, priority=2 if low_first else 9), 3.0)
    out = _step(sched, 4.0)
    if low_first:  # a alone (140) does not cover 250, and b, c are not less urgent: none
        assert not out.preempted
    else:
        assert sorted(_ids(out.preempted)) == victims and _grants(out)[0] == ("h", 10, 0)


def test_each_victim_makes_the_tree_evict_for_the_requests_left():
    """``release_req(i, len(reqs) - released)`` (:1771) evicts the radix cache until 20 slots per
    request left (in SGLang's count) are free, as after a retraction: 3 running, one victim, so
    40 slots; the 10 free and r1's 10 fall short, and the cached 40-token leaf goes."""
    sched = _sched(80, max_running_requests=3)
    assert sched.kv_cache.warm(list(range(1000, 1040)))
    _running(sched, "r1", 10, 12, 0)
    _running(sched, "r2", 10, 12, 20)
    _running(sched, "r3", 10, 12, 20)
    assert sched.kv_cache.num_free_blocks == 10
    sched.add_request(Request("h", 5, 4, 1.0, priority=11), 1.0)
    out = _step(sched, 2.0)
    assert _ids(out.preempted) == ["r1"]
    assert sched.policy.tree.stats.num_evicted_tokens == 40


def test_a_spent_chunk_budget_ends_the_walk_before_any_preemption():
    """``if adder.budget_state() == AddReqResult.OTHER: break`` (scheduler.py:4207) comes first
    in the walk: the continuing chunk took the whole chunk budget, so h is not even considered
    for preemption (the running cap would have let it try)."""
    sched = _sched(1000, max_running_requests=1, chunked_prefill_size=32)
    policy: SglangPolicy = sched.policy
    _running(sched, "d", 10, 50, 0)
    c = Request("c", 100, 4, 0.0)
    c.num_computed_tokens, c.status = 20, RequestStatus.RUNNING
    assert sched.allocate(c, 20)
    sched.running.append(c)
    policy.chunked = c
    sched.add_request(Request("h", 5, 4, 1.0, priority=50), 1.0)
    out = _step(sched, 2.0)
    assert _grants(out) == [("c", 32, 20)] and not out.preempted


def test_mixing_needs_chunked_prefill():
    """``is_mixed_chunk = chunked_prefill_size is not None and enable_mixed_chunk``
    (scheduler.py:1376): without chunking the decodes neither ride along nor take budget."""
    sched = _sched(1000, enable_priority_scheduling=False, enable_mixed_chunk=True, chunked_prefill_size=-1,
                   max_prefill_tokens=20)  # fmt: skip
    _running(sched, "d", 10, 50, 0)
    sched.add_request(Request("w", 20, 4, 1.0), 1.0)
    sched.add_request(Request("v", 1, 4, 1.0), 1.0)
    # w takes the 20-token input budget whole (the first may); v does not fit the rest.
    assert _grants(_step(sched, 2.0)) == [("w", 20, 0)]
