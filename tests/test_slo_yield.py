"""Rules 10-11 of the ``slo`` policy (over-share tenants yield a protected tenant's prefill
iterations; their chunks keep short quanta while it runs), on hand-worked cases with the linear predicted iteration time of test_slo_policy
(5 ms + 10 us a token), and in whole simulated runs: its bound on a yielding decode's gap, that
it is inert without tenants, and what it buys the protected tenant."""

from __future__ import annotations

import numpy as np
import pytest
from tests.test_slo_fair import _partial
from tests.test_slo_policy import _setup

from tailserve.core.engine import Engine, EngineOptions
from tailserve.core.request import Request
from tailserve.core.scheduler import Scheduler
from tailserve.core.source import ListSource
from tailserve.executors.simulated.cost_binding import bind_cost_model
from tailserve.executors.simulated.cost_model import CostModel
from tailserve.executors.simulated.driver import SimDriver
from tailserve.executors.simulated.executor import SimExecutor
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.executors.simulated.models import get_model
from tailserve.kv.paged import KVCacheManager
from tailserve.policies.slo import SloPolicy
from tailserve.policies.slo_config import SloConfig
from tailserve.policies.tenant_share import RecentService


def _running(sched: Scheduler, rid: str, prompt: int, computed: int, tenant: str, last_token: float | None):
    """A running request of ``tenant`` with ``computed`` tokens in KV; with ``last_token``, one
    that has produced its first token then (a decode)."""
    r = _partial(sched, rid, prompt, computed, tenant)
    if last_token is not None:
        r.num_output_tokens = 1
        r.token_times.append(last_token)
    return r


def _grants(out) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_shares_names_the_tenants_over_their_fair_share():
    recent = RecentService()
    recent.step({"light": 100.0, "mid": 4_000.0, "heavy": 10_000.0})
    one = lambda t: 1.0  # noqa: E731
    # Fair rank 14,100 / 3 = 4,700: light (100 < 2,350) protected, heavy (> 4,700) over,
    # mid (between half and all of its share) neither.
    assert recent.shares({"light", "mid", "heavy"}, one) == ({"light"}, {"heavy"})
    assert recent.shares({"heavy"}, one) == (frozenset(), frozenset())


def _case(yield_tbts: float):
    policy, sched = _setup(num_blocks=4096, fairness="vtc", yield_tbts=yield_tbts)
    _running(sched, "ld", 100, 100, "light", last_token=0.0)  # light's decode, due at 50 ms
    for i in range(100):
        _running(sched, f"h{i}", 100, 100, "heavy", last_token=0.0)
    # Heavy's last token 105 ms ago: past 2 x its 50 ms TBT, it no longer yields.
    _running(sched, "hlate", 100, 100, "heavy", last_token=-0.095)
    _running(sched, "hp", 2000, 1000, "heavy", last_token=None)  # heavy's partial prefill
    sched.add_request(Request("hnew", 500, 10, 0.0, tenant_id="heavy"), 0.0)
    sched.add_request(Request("new", 6000, 10, 0.0, tenant_id="light"), 0.0)
    policy.backlog.recent.step({"heavy": 10_000.0, "light": 100.0})
    return sched.schedule(0.010)  # light's decode has 40 ms of slack


def test_over_share_decodes_sit_out_a_protected_prefill_iteration():
    # Rule 10: heavy's 100 decodes (gap 10 ms < 100 ms), partial prefill and admission sit out.
    # Light's chunk is bounded by light's decode only: 5 ms + 10 us x (2 decodes + q) <= 40 ms
    # -> q = 3,498, 26 % more prefill than beside all 102 decodes.
    assert _grants(_case(2.0)) == {"ld": 1, "hlate": 1, "new": 3498}
    # Rule 10 off (rule 9 alone): every decode rides along, 102 + q <= 3,500 -> q = 3,398; heavy's
    # chunks find no room left under hlate's (negative) slack and the spent floor.
    off = _grants(_case(0.0))
    assert off == {"ld": 1, "hlate": 1, **{f"h{i}": 1 for i in range(100)}, "new": 3398}


@pytest.mark.parametrize("quantum", [0.8, 0.0])
def test_an_over_share_chunk_keeps_the_iteration_within_the_quantum(quantum):
    policy, sched = _setup(num_blocks=4096, fairness="vtc", quantum_tbts=quantum)
    _running(sched, "ld", 100, 100, "light", last_token=0.0)  # protected, TBT 50 ms
    _running(sched, "hp", 6000, 1000, "heavy", last_token=None)
    policy.backlog.recent.step({"heavy": 10_000.0, "light": 100.0})
    # Light has no prefill: rule 10 does not fire. Rule 11 holds heavy's chunk to 0.8 x 50 ms:
    # 5 ms + 10 us x (1 + q) <= 40 ms -> q = 3,499; off, the slack's 50 ms -> q = 4,499.
    want = {0.8: 3499, 0.0: 4499}[quantum]
    assert _grants(sched.schedule(0.0)) == {"ld": 1, "hp": want}


def test_yielded_decodes_are_put_back_when_no_protected_chunk_fits():
    policy, sched = _setup(num_blocks=100, fairness="vtc")
    _running(sched, "ld", 1000, 1000, "light", last_token=0.0)  # 63 blocks
    _running(sched, "h0", 200, 200, "heavy", last_token=0.0)  # 13 blocks each: 11 left free
    _running(sched, "h1", 200, 200, "heavy", last_token=0.0)
    # 38 blocks: more than free + all of heavy's (37), so rule 9 preempts nobody and it waits.
    sched.add_request(Request("new", 600, 10, 0.0, tenant_id="light"), 0.0)
    policy.backlog.recent.step({"heavy": 10_000.0, "light": 100.0})
    out = sched.schedule(0.010)
    assert _grants(out) == {"ld": 1, "h0": 1, "h1": 1} and not out.preempted


@pytest.mark.parametrize("fairness", ["none", "vtc"])
def test_a_decodes_kv_comes_from_an_unprotected_tenant_first(fairness):
    policy, sched = _setup(num_blocks=15, fairness=fairness, yield_tbts=0.0)
    _running(sched, "ld", 96, 96, "light", last_token=0.0)  # 6 full blocks: its next token needs a 7th
    _running(sched, "l2", 32, 32, "light", last_token=0.001)  # 2 blocks
    _running(sched, "h", 100, 100, "heavy", last_token=0.002)  # 7 blocks: none left free
    if fairness == "vtc":
        policy.backlog.recent.step({"heavy": 10_000.0, "light": 100.0})
    out = sched.schedule(0.010)
    # Nobody's recompute (5 ms + 10 us a token) makes it late, so rule 7 alone takes the cheaper
    # one, l2 (32 tokens); under fairness the unprotected heavy tenant's request goes first.
    victim = {"none": "l2", "vtc": "h"}[fairness]
    assert [r.request_id for r in out.preempted] == [victim]
    assert set(_grants(out)) == {"ld", "l2", "h"} - {victim}


def test_yield_tbts_is_checked():
    with pytest.raises(ValueError, match="yield_tbts must be a finite number"):
        SloConfig(2048, 256, yield_tbts=-1.0)
    with pytest.raises(ValueError, match="quantum_tbts must be a finite number"):
        SloConfig(2048, 256, quantum_tbts=float("inf"))


COST = CostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"), 1)


def _run(requests: list[Request], fast: bool = True, **flags) -> tuple[Engine, list[Request]]:
    policy = SloPolicy(SloPolicy.default_config(get_hardware("H100-SXM").device_info, 4096, **flags))
    fresh = [
        Request(r.request_id, r.prompt_len, r.max_tokens, r.arrival_time, tenant_id=r.tenant_id)
        for r in requests
    ]
    sched = Scheduler(policy, KVCacheManager(60_000 // 16, 16), 4096)
    bind_cost_model(policy, COST)  # predicts with the simulator's cost model
    engine = Engine(sched, SimExecutor(COST, 16), ListSource(fresh), options=EngineOptions(fast, True))
    SimDriver(engine).run()
    return engine, fresh


def _two_tenants(tenants: bool = True) -> list[Request]:
    """Light: 1,000-3,000-token prompts at ~6/s; heavy: 200-600-token prompts at 80/s (past
    capacity), for 2 s."""
    rng = np.random.default_rng(7)
    out = []
    for i, t in enumerate(np.cumsum(rng.exponential(1 / 6, 12))):
        out.append(Request(f"l{i}", int(rng.integers(1000, 3000)), 40, float(t), tenant_id="light"))
    for i, t in enumerate(np.cumsum(rng.exponential(1 / 80, 160))):
        out.append(
            Request(
                f"h{i}", int(rng.integers(200, 600)), int(rng.integers(50, 150)), float(t), tenant_id="heavy"
            )
        )
    out.sort(key=lambda r: r.arrival_time)
    if not tenants:
        for r in out:
            r.tenant_id = None
    return out


FLAGS = {"fairness": "vtc", "slo_classes": "all=ttft:2s,tbt:50ms"}


def _ttft_p99(requests: list[Request], tenant: str) -> float:
    return float(
        np.percentile([r.token_times[0] - r.arrival_time for r in requests if r.tenant_id == tenant], 99)
    )


def test_a_yielding_decode_waits_no_longer_than_its_bound_and_light_gains():
    engine, requests = _run(_two_tenants(), **FLAGS)
    assert all(r.is_finished for r in requests)
    log = engine.log
    starts = np.asarray(log.start)
    ends = starts + np.asarray(log.duration)
    worst_gap = 0.0
    for r in requests:
        if r.tenant_id != "heavy" or r.num_preemptions:
            continue
        for prev, nxt in zip(r.token_times, r.token_times[1:]):
            worst_gap = max(worst_gap, nxt - prev)
            # The iteration that produced ``nxt`` started no later than the first iteration
            # starting once the gap reached 2 x 50 ms: a yielding decode sits out no further.
            k = int(np.argmin(np.abs(ends - nxt)))
            later = starts[(starts >= prev + 0.1 - 1e-12) & (starts < starts[k] - 1e-12)]
            assert later.size == 0, (r.request_id, prev, nxt)
    _, off = _run(_two_tenants(), yield_tbts=0.0, **FLAGS)
    off_gap = max(
        b - a
        for r in off
        if r.tenant_id == "heavy" and not r.num_preemptions
        for a, b in zip(r.token_times, r.token_times[1:])
    )
    # Rule 10 fired (heavy's decodes sat out: longer gaps), and light's long prompts were
    # prefilled in fewer iterations.
    assert worst_gap > off_gap
    assert _ttft_p99(requests, "light") < _ttft_p99(off, "light")


def test_the_fast_path_stays_exact_with_rule_10():
    _, fast = _run(_two_tenants(), True, **FLAGS)
    _, stepped = _run(_two_tenants(), False, **FLAGS)
    assert [(r.status, r.token_times) for r in fast] == [(r.status, r.token_times) for r in stepped]


@pytest.mark.parametrize("flags", [{}, {"fairness": "vtc"}])
def test_rules_10_and_11_are_inert_without_tenants(flags):
    _, on = _run(_two_tenants(tenants=False), **flags)
    _, off = _run(_two_tenants(tenants=False), yield_tbts=0.0, quantum_tbts=0.0, **flags)
    assert [r.token_times for r in on] == [r.token_times for r in off]
