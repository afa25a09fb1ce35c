"""SGLang 0.5.23's newer waiting-queue orders, hand-worked: ``hrrn``, ``shortest-prefill-first``,
``routing-key``, and the scheduler state they read (the processed-tokens counter and snapshots,
the running batch's keys). Line numbers are ``sglang/srt/managers/schedule_policy.py`` and
``scheduler.py`` of the 0.5.23 package.

Orders are checked through ``validate.sglang_order.run_tailserve_order`` (the policy's own
``order_waiting`` over a radix tree warmed with the ``cached`` sequences), the same path the
differential against SGLang's ``calc_priority`` takes; the counter and the chunk cap through
whole policy steps.
"""

from __future__ import annotations

import pytest

from helpers import grants as _grants
from helpers import scheduler_for
from helpers import step as _step
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.policies.sglang import SglangConfig, SglangPolicy
from tailserve.policies.sglang_adder import AddReqResult, PrefillAdder
from tailserve.policies.sglang_order_work import shortest_prefill_chunk_limit
from tailserve.validate.sglang_order import OrderCase, WaitingSpec, run_tailserve_order


def _w(rid: str, n: int, start: int, snapshot: int = 0, **kw) -> WaitingSpec:
    return WaitingSpec(rid, list(range(start, start + n)), 4, arrival_processed_tokens=snapshot, **kw)


def _order(policy: str, waiting: list[WaitingSpec], **kw) -> list[str]:
    return run_tailserve_order(OrderCase(policy, kw.pop("cached", []), waiting, **kw)).order


# ---- hrrn: _sort_by_hrrn (schedule_policy.py:460) ---------------------------------------------


def test_hrrn_orders_by_tokens_waited_per_uncached_prompt_token_ties_by_id():
    """ratio = (counter - snapshot) / uncached prompt tokens, highest first; equal ratios go by
    request id, never by queue position. e's 60-token prompt has 50 cached: 100 / 10."""
    waiting = [
        _w("d", 20, 1000, snapshot=800),  # 200 / 20 = 10
        _w("b", 10, 2000, snapshot=950),  # 50 / 10 = 5
        _w("e", 60, 5000, snapshot=900),  # 100 / 10 = 10
        _w("a", 100, 3000, snapshot=0),  # 1000 / 100 = 10
        _w("c", 40, 4000, snapshot=200),  # 800 / 40 = 20
    ]
    cached = [list(range(5000, 5050))]
    assert _order("hrrn", waiting, cached=cached, processed_tokens=1000) == ["c", "a", "d", "e", "b"]


def test_hrrn_a_prompt_with_nothing_to_prefill_drains_first_and_dedup_goes_last():
    """Uncached counts the prompt only (``_uncached_len``, :454): r, retracted with 5 outputs,
    has its prompt and 3 outputs cached, so it has no prefill work and goes first (-inf). y
    shares 40 uncached tokens with x ahead of it: deprioritized (+inf, ``_compute_prefix_matches``)."""
    stem = list(range(7000, 7040))
    waiting = [
        WaitingSpec("x", [*stem, 1], 4, arrival_processed_tokens=0),
        WaitingSpec("y", [*stem, 2], 4, arrival_processed_tokens=0),
        WaitingSpec("z", list(range(8000, 8010)), 4, arrival_processed_tokens=90),
        WaitingSpec("r", list(range(9000, 9020)), 9, output_token_ids=list(range(9100, 9105))),
    ]
    cached = [list(range(9000, 9020)) + list(range(9100, 9103))]
    # x: 100/41, z: 10/10, r: -inf; y: +inf.
    assert _order("hrrn", waiting, cached=cached, processed_tokens=100) == ["r", "x", "z", "y"]


def test_hrrn_and_lpm_skip_matching_above_128_waiting_but_shortest_prefill_first_does_not():
    """``_determine_active_policy`` (:304): lpm and hrrn turn into a plain fcfs pass (the queue
    kept) above ``WAITING_QUEUE_PREFIX_MATCH_MAX`` = 128; shortest-prefill-first never does."""
    waiting = [_w(f"r{i:03d}", 130 - i, 10_000 * (i + 1), snapshot=i) for i in range(130)]
    queue = [w.request_id for w in waiting]
    assert _order("hrrn", waiting, processed_tokens=1000) == queue
    assert _order("lpm", waiting) == queue
    assert _order("shortest-prefill-first", waiting) == list(reversed(queue))


# ---- shortest-prefill-first: _sort_by_shortest_prefill (:406) ------------------------------


def test_shortest_prefill_first_orders_by_work_then_queue_time_dedup_last():
    """work = prompt + outputs - capped match, at least 1 (``_shortest_prefill_work``, :399):
    c's 30 tokens are all cached, so its match is capped at 29 and its work is 1; r's outputs
    count (25 + 5 - 0). Equal work goes by queue time; y (dedup) is last whatever its work."""
    stem = list(range(7000, 7040))
    waiting = [
        WaitingSpec("late", list(range(1000, 1010)), 4, queue_time=5.0),
        WaitingSpec("x", [*stem, 1], 4, queue_time=0.0),
        WaitingSpec("y", [*stem, 2], 4, queue_time=0.0),
        WaitingSpec("early", list(range(2000, 2010)), 4, queue_time=1.0),
        WaitingSpec("c", list(range(3000, 3030)), 4, queue_time=9.0),
        WaitingSpec(
            "r", list(range(4000, 4025)), 9, queue_time=0.0, output_token_ids=list(range(4100, 4105))
        ),
    ]
    cached = [list(range(3000, 3030))]
    assert _order("shortest-prefill-first", waiting, cached=cached) == ["c", "early", "late", "r", "x", "y"]


def test_shortest_prefill_first_needs_the_radix_cache():
    """``_validate_and_adjust_policy`` (:333): the one cache-aware policy that does not fall
    back to fcfs without the cache; SGLang stops at start."""
    with pytest.raises(ValueError, match="requires the radix cache"):
        SglangConfig(schedule_policy="shortest-prefill-first", disable_radix_cache=True)
    # hrrn falls back to fcfs (the queue kept) like lpm
    waiting = [_w("a", 10, 100, snapshot=90), _w("b", 10, 200, snapshot=0)]
    case = OrderCase("hrrn", [], waiting, processed_tokens=100)
    assert run_tailserve_order(case).order == ["b", "a"]
    policy = SglangPolicy(SglangConfig(schedule_policy="hrrn", disable_radix_cache=True))
    assert policy.kv_spec().kind == "paged"


@pytest.mark.parametrize(
    ("remaining", "works", "budget", "page", "limit"),
    [
        (100, [10, 20, 200], 64, 1, 34),  # reserve 10 + 20; 200 is not shorter than the rest
        (100, [10, 20, 5], 64, 16, 16),  # charges 16 + 32 = 48 <= 64 - 16; then 16 more would not fit
        (100, [150, 10], 64, 1, None),  # the head is not shorter than the chunk's rest: no cap
        (100, [10], 1, 1, None),  # under two pages of budget
        (100, [70], 64, 1, None),  # 70 > 64 - 1: nothing reserved
    ],
)
def test_the_chunk_cap_keeps_budget_for_shorter_waiting_requests(remaining, works, budget, page, limit):
    """``shortest_prefill_chunk_limit`` (:418): walk the ordered queue while each request is
    shorter than the chunk's rest and its paged work fits under budget - one page."""
    waiting = [Request(f"w{i}", n, 1, 0.0) for i, n in enumerate(works)]
    assert shortest_prefill_chunk_limit(remaining, waiting, {}, budget, page) == limit


def _sched(num_blocks: int, **cfg) -> Scheduler:
    return scheduler_for(SglangPolicy(SglangConfig(**cfg)), num_blocks, 1, 4096)


def _token_request(rid: str, start: int, n: int, max_tokens: int = 4, t: float = 0.0) -> Request:
    return Request(rid, n, max_tokens, t, prompt_token_ids=list(range(start, start + n)))


@pytest.mark.parametrize(("policy", "grants"), [
    ("shortest-prefill-first", [("L", 34, 64), ("s1", 10, 0), ("s2", 20, 0)]),
    ("fcfs", [("L", 64, 64)]),
])  # fmt: skip
def test_a_continuing_chunk_leaves_room_for_shorter_requests(policy, grants):
    """scheduler.py:4178: with shortest-prefill-first the chunked request's next chunk is cut to
    64 - (10 + 20) so s1 and s2 (shorter than its 136 left) prefill in the same batch."""
    sched = _sched(2000, schedule_policy=policy, chunked_prefill_size=64)
    sched.add_request(_token_request("L", 0, 200), 0.0)
    assert _grants(_step(sched)) == [("L", 64, 0)]
    sched.add_request(_token_request("s2", 1000, 20, t=1.0), 1.0)
    sched.add_request(_token_request("s1", 2000, 10, t=1.0), 1.0)
    assert _grants(_step(sched, 1.0)) == grants


def test_only_one_chunked_request_under_shortest_prefill_first():
    """``_select_prefill_admission`` (:1649): a request that would need a chunk while another
    chunked request is unfinished waits (OTHER). Under the other policies SGLang would cut it
    and then fail ``assert self.chunked_req is None`` (scheduler.py:4326); tailserve lets it
    wait too, and counts it."""
    for spf, counted in ((True, 0), (False, 1)):
        sched = _sched(1000)
        adder = PrefillAdder(sched, sched.policy.radix, [], 0.7, 16384, 50, shortest_prefill_first=spf)
        request = Request("big", 80, 4, 0.0)
        assert adder.add_one_req(request, None, has_chunked_req=True) is AddReqResult.OTHER
        assert adder.num_second_chunks_refused == counted and not adder.can_run
        assert (
            adder.add_one_req(request, None, has_chunked_req=False) is AddReqResult.OTHER
        )  # the chunk spent
        assert _grants_of(adder) == [("big", 50, 0)] and adder.new_chunked is request


def _grants_of(adder: PrefillAdder) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_new_tokens, s.num_context_tokens) for s in adder.can_run]


# ---- routing-key: _sort_by_routing_key (:538) ------------------------------------------------


def test_routing_key_puts_the_running_batchs_commonest_keys_first():
    """Keys most common in the running batch first (ties by key), then the rest by key with no
    key as "" (stable); tailserve's ``tenant_id`` is the routing key."""
    waiting = [
        WaitingSpec("x", [1], 4),
        WaitingSpec("y", [2], 4, routing_key="b"),
        WaitingSpec("z", [3], 4, routing_key="a"),
        WaitingSpec("w", [4], 4, routing_key="c"),
        WaitingSpec("v", [5], 4, routing_key="a"),
        WaitingSpec("u", [6], 4, routing_key=""),
    ]
    running = ["a", "b", "a", None, ""]
    assert _order("routing-key", waiting, running_keys=running) == ["z", "v", "y", "x", "u", "w"]
    assert _order("routing-key", waiting, running_keys=[None, ""]) == ["x", "y", "z", "w", "v", "u"]


# ---- the counter hrrn ages by (scheduler.py:479, 3495, 4633) ---------------------------------


def test_the_policy_keeps_the_processed_tokens_counter_and_snapshots():
    """``run_batch`` adds each prefill batch's extend tokens (a decode batch adds none, a mixed
    batch its decodes too); ``_add_request_to_queue`` stamps arrivals and requeued requests."""
    sched = _sched(1000, schedule_policy="hrrn", chunked_prefill_size=64, enable_mixed_chunk=True)
    policy: SglangPolicy = sched.policy
    sched.add_request(_token_request("a", 0, 30, max_tokens=3), 0.0)
    assert policy.processed.snapshot == {"a": 0}
    _step(sched)  # prefill a: 30
    assert policy.processed.count == 30
    _step(sched, 1.0)  # decode: nothing
    assert policy.processed.count == 30
    sched.add_request(_token_request("b", 100, 20), 1.0)
    assert policy.processed.snapshot["b"] == 30
    assert _grants(_step(sched, 2.0)) == [("b", 20, 0), ("a", 1, 31)]  # mixed: 20 + 1
    assert policy.processed.count == 51


@pytest.mark.parametrize(("policy", "admitted"), [("hrrn", "new"), ("fcfs", "old")])
def test_hrrn_ages_a_waiting_request_by_the_tokens_prefilled_since(policy, admitted):
    """Behind a one-request cap, "old" (300 tokens, snapshot 0) and "new" (5 tokens, stamped
    after the first 32-token chunk) wait while "first" prefills its 60 tokens in two chunks:
    old has waited 60 / 300 = 0.2, new 28 / 5 = 5.6, so hrrn admits new; fcfs keeps old first."""
    sched = _sched(1000, schedule_policy=policy, max_running_requests=1, chunked_prefill_size=32)
    policy_: SglangPolicy = sched.policy
    sched.add_request(_token_request("first", 0, 60, max_tokens=2), 0.0)
    sched.add_request(_token_request("old", 1000, 300), 0.0)
    assert _grants(_step(sched)) == [("first", 32, 0)]
    sched.add_request(_token_request("new", 2000, 5, t=0.5), 0.5)
    assert policy_.processed.snapshot == {"first": 0, "old": 0, "new": 32}
    assert _grants(_step(sched, 1.0)) == [("first", 28, 32)]  # the cap holds the rest back
    assert _grants(_step(sched, 2.0)) == [("first", 1, 60)]  # first's last token
    assert [g[0] for g in _grants(_step(sched, 3.0))] == [admitted]
