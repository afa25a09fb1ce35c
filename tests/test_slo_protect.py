"""Rule 9 of the ``slo`` policy, its three parts added for the fairness target on every seed
(docs/experiments.md §8): protection held until the tenant has its share, a protected tenant's
queue time counted among protected requests only, and its feasible requests served in arrival
order. Hand-worked with the linear predicted iteration time of test_slo_policy (5 ms + 10 us a
token; interactive class: TTFT 500 ms, TBT 50 ms)."""

from __future__ import annotations

import pytest
from tests.test_slo_fair import _partial
from tests.test_slo_policy import _setup
from tests.test_slo_yield import _run, _two_tenants

from tailserve.core.request import Request
from tailserve.policies.slo_config import SloConfig
from tailserve.policies.tenant_share import RecentService

ONE = lambda t: 1.0  # noqa: E731


def test_a_protected_tenant_stays_protected_until_it_has_its_share():
    recent = RecentService()
    recent.step({"light": 3_000.0, "heavy": 7_000.0})
    # Fair rank 5,000: light's 3,000 is past half of it (2,500), so it does not become protected...
    assert recent.shares({"light", "heavy"}, ONE) == (frozenset(), {"heavy"})
    # ... but protected the iteration before, it stays so until 5,000 (until=1, the default) ...
    assert recent.shares({"light", "heavy"}, ONE, frozenset({"light"}), 1.0) == ({"light"}, {"heavy"})
    # ... or 3,750 (until=0.75), and not with the hold off (until=0.5) or past a smaller hold
    # (0.6 x 5,000 = 3,000).
    assert recent.shares({"light", "heavy"}, ONE, frozenset({"light"}), 0.75)[0] == {"light"}
    assert recent.shares({"light", "heavy"}, ONE, frozenset({"light"}), 0.5)[0] == frozenset()
    assert recent.shares({"light", "heavy"}, ONE, frozenset({"light"}), 0.6)[0] == frozenset()
    recent = RecentService()
    recent.step({"light": 6_000.0, "heavy": 4_000.0})
    # Past its whole share a held tenant is over it, not protected.
    assert recent.shares({"light", "heavy"}, ONE, frozenset({"light"}), 1.0) == (frozenset(), {"light"})


@pytest.mark.parametrize("until", [None, 0.5])
def test_the_policy_holds_protection_from_one_iteration_to_the_next(until):
    policy, sched = _setup(fairness="vtc", **({} if until is None else {"protect_until": until}))
    _partial(sched, "lp", 2000, 1000, "light")
    _partial(sched, "hp", 2000, 1000, "heavy")
    recent = policy.backlog.recent
    recent.step({"light": 100.0, "heavy": 10_000.0})
    sched.schedule(0.0)
    assert policy.state.protected == {"light"}
    # Light's burst: its recent service now 30% of the total, past half its share (25%) but
    # under the default hold's whole share (50%).
    recent.served = {"light": 3_000.0, "heavy": 7_000.0}
    sched.schedule(0.05)
    assert policy.state.protected == ({"light"} if until is None else frozenset())
    # Past its share (60% of the total) the hold ends: light is over its share now.
    recent.served = {"light": 6_000.0, "heavy": 4_000.0}
    sched.schedule(0.1)
    assert policy.state.protected == frozenset() and policy.state.over == {"light"}


def _queue(fairness: str):
    policy, sched = _setup(fairness=fairness, slo_admission="reject")
    # Five heavy prompts of 8,000 tokens (85 ms each, slack 415 ms) ahead of light's 7,500
    # (80 ms, slack 420 ms) in rule 3's order, all due at 500 ms.
    for i in range(5):
        sched.add_request(Request(f"h{i}", 8000, 10, 0.0, tenant_id="heavy"), 0.0)
    sched.add_request(Request("l", 7500, 10, 0.0, tenant_id="light"), 0.0)
    if policy.backlog is not None:
        policy.backlog.recent.step({"light": 0.0, "heavy": 10_000.0})
        policy.protect(sched)
    return policy.order_waiting(sched, 0.0)


def test_a_protected_requests_queue_is_the_protected_requests_ahead():
    # Without fairness light's queue is heavy's 5 x 85 = 425 ms: 425 + 80 > 500, infeasible, and
    # (reject) turned away.
    ordered, rejected = _queue("none")
    assert [r.request_id for r in rejected] == ["l"]
    # Protected, it is served before heavy (rule 9), so nothing is ahead of it: 80 <= 500 ms.
    ordered, rejected = _queue("vtc")
    assert rejected == [] and ordered[0].request_id == "l"


@pytest.mark.parametrize("order", ["arrival", "slack"])
def test_a_protected_tenants_feasible_requests_go_in_arrival_order(order):
    policy, sched = _setup(fairness="vtc", protected_order=order)
    # Light: a short prompt, then 4 ms later a long one (deadlines 500 / 504 ms; slack 491 / 459 ms).
    sched.add_request(Request("l_short", 400, 10, 0.000, tenant_id="light"), 0.000)
    sched.add_request(Request("l_long", 4000, 10, 0.004, tenant_id="light"), 0.004)
    # Heavy (over its share) in the same pattern keeps rule 3's least-slack order.
    sched.add_request(Request("h_short", 400, 10, 0.000, tenant_id="heavy"), 0.000)
    sched.add_request(Request("h_long", 4000, 10, 0.002, tenant_id="heavy"), 0.002)
    policy.backlog.recent.step({"light": 0.0, "heavy": 10_000.0})
    policy.protect(sched)
    ordered, _ = policy.order_waiting(sched, 0.010)
    light = ["l_short", "l_long"] if order == "arrival" else ["l_long", "l_short"]
    assert [r.request_id for r in ordered] == [*light, "h_long", "h_short"]


def test_the_new_flags_are_checked():
    with pytest.raises(ValueError, match=r"protect_until must be a fraction of the fair share in \[0.5, 1\]"):
        SloConfig(2048, 256, protect_until=0.4)
    with pytest.raises(ValueError, match="protect_until"):
        SloConfig(2048, 256, protect_until=float("nan"))
    with pytest.raises(ValueError, match="protected_order must be arrival or slack, got 'fifo'"):
        SloConfig(2048, 256, protected_order="fifo")


@pytest.mark.parametrize("flags", [{}, {"fairness": "vtc"}])
def test_the_rule_9_parts_are_inert_without_tenants(flags):
    _, on = _run(_two_tenants(tenants=False), **flags)
    _, off = _run(_two_tenants(tenants=False), protect_until=0.5, protected_order="slack", **flags)
    assert [r.token_times for r in on] == [r.token_times for r in off]
