"""Rule 9 of the ``slo`` policy (tailserve's isolation beside VTC) and ``RecentService``, on
hand-worked cases with the linear predicted iteration time of test_slo_policy (5 ms + 10 us a
token)."""

from __future__ import annotations

import pytest
from tests.test_slo_policy import _decoding, _setup

from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.policies.fairness import TenantBacklog
from tailserve.policies.tenant_share import RecentService
from tailserve.policies.vtc import VirtualTokenCounter


def test_recent_service_decays_per_iteration_and_a_run_equals_its_steps():
    recent = RecentService(window=4)  # decay 0.75 an iteration
    recent.step({"a": 100.0})
    recent.step({"b": 40.0})
    assert recent.rank("a") == pytest.approx(75.0) and recent.rank("b") == pytest.approx(40.0)
    stepped, run = RecentService(window=8), RecentService(window=8)
    stepped.step({"a": 10.0})
    run.step({"a": 10.0})
    for _ in range(5):
        stepped.step({"a": 3.0, "b": 2.0})
    run.step({"a": 3.0, "b": 2.0}, num_steps=5)
    assert run.served == pytest.approx(stepped.served)
    with pytest.raises(ValueError, match="window must be >= 1"):
        RecentService(window=0)


def test_protected_means_under_half_the_weighted_share():
    recent = RecentService()
    recent.step({"light": 100.0, "heavy": 10_000.0})
    one = lambda t: 1.0  # noqa: E731
    # Fair rank 5,050; light's 100 < 2,525: protected. Heavy never is.
    assert recent.protected({"light", "heavy"}, one) == {"light"}
    assert recent.protected({"light"}, one) == frozenset()  # alone: nobody to be protected from
    recent = RecentService()
    recent.step({"a": 4_000.0, "b": 6_000.0})
    assert recent.protected({"a", "b"}, one) == frozenset()  # both past half their share
    # Weights: b entitled to 9x a's share. Per unit of weight a used 4,000, b 6,000 / 9 = 667;
    # the fair rank is 10,000 raw / 10 = 1,000, so b (667) is not under half of it either...
    recent = RecentService()
    recent.step({"a": 4_000.0, "b": 6_000.0 / 9})
    weights = {"a": 1.0, "b": 9.0}.__getitem__
    assert recent.protected({"a", "b"}, weights) == frozenset()
    # ... while at 3,000 raw (333 a unit of weight) it is.
    recent = RecentService()
    recent.step({"a": 4_000.0, "b": 3_000.0 / 9})
    assert recent.protected({"a", "b"}, weights) == {"b"}


def test_vtc_ties_go_to_the_tenant_with_less_recent_service():
    backlog = TenantBacklog(VirtualTokenCounter())
    backlog.vtc.charge("heavy", 1000)
    backlog.vtc.charge("light", 1000)  # the lifted counter: a tie
    backlog.recent.step({"heavy": 5000.0, "light": 10.0})
    h, light = Request("h", 100, 1, 0.0, tenant_id="heavy"), Request("l", 100, 1, 0.1, tenant_id="light")
    assert [r.request_id for r in backlog.order([h, light])] == ["l", "h"]


def _partial(sched: Scheduler, rid: str, prompt: int, computed: int, tenant: str) -> Request:
    """A running request part way through its prefill."""
    r = Request(rid, prompt, 100, 0.0, tenant_id=tenant)
    sched.add_request(r, 0.0)
    sched.waiting.remove(r)
    sched.policy.state.info.pop(rid)
    if sched.policy.backlog is not None:
        sched.policy.backlog.dequeue(r)
    assert sched.allocate(r, computed)
    r.num_computed_tokens = computed
    sched.admit(r, 0.0)
    return r


def test_a_protected_tenant_goes_before_partial_prefills_and_ignores_their_slack():
    def setup(fairness: str):
        policy, sched = _setup(fairness=fairness, yield_tbts=0.0)  # rule 9 alone (rule 10: test_slo_yield)
        d = _decoding(sched, "hd", 100, last_token=0.0)  # heavy's decode, due at 50 ms
        d.tenant_id = "heavy"
        _partial(sched, "hp", 2000, 1000, "heavy")
        if policy.backlog is not None:
            policy.backlog.recent.step({"heavy": 10_000.0})
        sched.add_request(Request("new", 1000, 10, 0.0, tenant_id="light"), 0.0)
        return sched.schedule(0.040)  # 10 ms of heavy's slack left

    # Without fairness: heavy's partial prefill first, 5 ms + 10 us x (1 + q) <= 10 ms -> 499
    # tokens; nothing is left for the newcomer (the floor of 64 is spent).
    plain = {s.request.request_id: s.num_new_tokens for s in setup("none").scheduled}
    assert plain == {"hd": 1, "hp": 499}
    # Light is protected (no recent service beside heavy's 10,000): admitted first, its chunk
    # bounded only by light's own decodes (none): all 1,000 tokens; heavy's partial prefill then
    # finds its 10 ms already taken (5 ms + 10.01 ms) and waits.
    fair = {s.request.request_id: s.num_new_tokens for s in setup("vtc").scheduled}
    assert fair == {"hd": 1, "new": 1000}


def _tenant_run(fast: bool, weights: str) -> tuple[Scheduler, list[Request]]:
    from tailserve.core.engine import Engine, EngineOptions
    from tailserve.core.source import ListSource
    from tailserve.executors.simulated.cost_binding import bind_cost_model
    from tailserve.executors.simulated.cost_model import CostModel
    from tailserve.executors.simulated.driver import SimDriver
    from tailserve.executors.simulated.executor import SimExecutor
    from tailserve.executors.simulated.hardware import get_hardware
    from tailserve.executors.simulated.models import get_model
    from tailserve.kv.paged import KVCacheManager
    from tailserve.policies.slo import SloPolicy

    device = get_hardware("H100-SXM").device_info
    policy = SloPolicy(
        SloPolicy.default_config(
            device, 1024, fairness="vtc", tenant_weights=weights, slo_classes="all=ttft:1s,tbt:30ms"
        )
    )
    sched = Scheduler(policy, KVCacheManager(3072 // 16, 16), 1024)
    # Heavy floods the small KV cache; light trickles in beside it (rule 9 preempts heavy).
    requests = [
        Request(f"h{i}", 200 + 37 * (i % 11), 40 + 13 * (i % 7), 0.002 * i, tenant_id="heavy")
        for i in range(80)
    ] + [Request(f"l{i}", 100 + 53 * (i % 5), 30, 0.05 + 0.04 * i, tenant_id="light") for i in range(12)]
    requests.sort(key=lambda r: r.arrival_time)
    cost = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)
    bind_cost_model(policy, cost)  # predicts with the simulator's cost model
    engine = Engine(sched, SimExecutor(cost, 16), ListSource(requests), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return sched, requests


@pytest.mark.parametrize("weights", ["", "light=3"])
def test_two_tenants_under_kv_pressure_lose_nothing_and_the_fast_path_is_exact(weights):
    sched, requests = _tenant_run(True, weights)
    assert len(sched.finished) == len(requests) and all(r.is_finished for r in requests)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    preempted = {t: sum(r.num_preemptions for r in requests if r.tenant_id == t) for t in ("heavy", "light")}
    # Rule 9 preempts heavy for light; rule 7 (a decode's KV growth) is tenant-blind.
    assert preempted["heavy"] > 5 * preempted["light"], preempted
    _, stepped = _tenant_run(False, weights)
    assert [(r.status, r.token_times) for r in requests] == [(r.status, r.token_times) for r in stepped]
