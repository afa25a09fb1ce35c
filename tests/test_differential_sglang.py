"""tailserve's ``sglang`` policy against SGLang 0.5.23's own ``SchedulePolicy.calc_priority``.

SGLang's ``Scheduler`` needs a model worker, so the differential runs at the level that runs on
CPU: one waiting-queue ordering pass over a real radix tree (docs/validation.md says what is not
covered). ``fixtures/differential/sglang.json`` holds SGLang's answers for seeded random cases,
recorded by ``python -m benchmarks.differential --engine sglang --record-fixture``; the live check is
``-m differential``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tailserve.policies import sglang_priority
from tailserve.validate.golden import load_fixture
from tailserve.validate.peers import PeerDriver, peer_python
from tailserve.validate.sglang_order import (
    ORDER_POLICIES,
    OrderCase,
    OrderResult,
    WaitingSpec,
    describe_difference,
    random_order_case,
    run_tailserve_order,
)

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "sglang.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    return load_fixture(FIXTURE)


def _cases(golden: dict) -> list[tuple[OrderCase, OrderResult]]:
    return [
        (OrderCase.from_compact(e["case"]), OrderResult(e["order"], e["prefix_len"], e.get("chunk_limit")))
        for e in golden["workloads"]
    ]


def test_golden_sglang_orders_are_identical(golden):
    assert golden["engine"] == "sglang" and golden["version"] == "0.5.23"
    cases = _cases(golden)
    assert len(cases) >= 200
    bad = [(c.seed, d) for c, theirs in cases if (d := describe_difference(run_tailserve_order(c), theirs))]
    assert not bad, f"{len(bad)} of {len(cases)} differ; first: seed {bad[0][0]}: {bad[0][1]}"


def test_golden_covers_the_policies_and_edge_cases(golden):
    cases = _cases(golden)
    assert {c.policy for c, _ in cases} == set(ORDER_POLICIES)
    assert {c.enable_priority_scheduling for c, _ in cases} == {True, False}
    for policy in ("lpm", "hrrn"):  # the fcfs fallback
        assert any(c.policy == policy and len(c.waiting) > 128 for c, _ in cases)
    assert any(v > 0 for _, r in cases for v in r.prefix_len.values())
    spf = [r for c, r in cases if c.policy == "shortest-prefill-first"]
    assert any(r.chunk_limit is not None for r in spf) and any(r.chunk_limit is None for r in spf)

    # hrrn: a retracted request whose match covers its prompt (nothing to prefill: first).
    def drains(c: OrderCase, r: OrderResult) -> bool:
        return any(
            w.output_token_ids and r.prefix_len.get(w.request_id, 0) >= len(w.prompt_token_ids)
            for w in c.waiting
        )

    assert any(c.policy == "hrrn" and drains(c, r) for c, r in cases)


def test_golden_check_catches_a_missing_in_batch_dedup(golden, monkeypatch):
    """Without SGLang's in-batch prefix dedup some recorded cache-aware orders no longer match."""
    monkeypatch.setattr(sglang_priority, "IN_BATCH_DEPRIORITIZE", 1 << 30)
    cases = [(c, r) for c, r in _cases(golden) if c.policy in ("lpm", "hrrn", "shortest-prefill-first")]
    assert any(describe_difference(run_tailserve_order(c), r) for c, r in cases)


def test_golden_check_catches_a_changed_order(golden):
    cases = [
        (c, r)
        for c, r in _cases(golden)
        if c.policy == "lof" and len(set(w.max_tokens for w in c.waiting)) > 2
    ]
    case, theirs = cases[0]
    assert describe_difference(run_tailserve_order(replace(case, policy="fcfs")), theirs) is not None


def test_lpm_sends_back_a_request_sharing_an_uncached_prefix_with_an_earlier_one():
    """SGLang's in-batch prefix caching: b shares 40 uncached tokens with a, so b waits behind
    c (no match at all) and a computes the prefix first."""
    stem = list(range(1000, 1040))
    waiting = [
        WaitingSpec("a", [*stem, 1], 4),
        WaitingSpec("b", [*stem, 2], 4),
        WaitingSpec("c", list(range(5000, 5010)), 4),
    ]
    result = run_tailserve_order(OrderCase("lpm", cached=[], waiting=waiting))
    assert result.order == ["a", "c", "b"]
    short = [WaitingSpec("a", [*stem[:20], 1], 4), WaitingSpec("b", [*stem[:20], 2], 4), waiting[2]]
    assert run_tailserve_order(OrderCase("lpm", cached=[], waiting=short)).order == ["a", "b", "c"]


def test_lpm_above_128_waiting_keeps_the_queue_even_with_priorities():
    waiting = [
        WaitingSpec(f"r{i:03d}", [10_000 + i], 4, priority=i % 3, queue_time=float(i)) for i in range(130)
    ]
    case = OrderCase("lpm", cached=[], waiting=waiting, enable_priority_scheduling=True)
    assert run_tailserve_order(case).order == [w.request_id for w in waiting]
    fcfs = replace(case, policy="fcfs")
    assert run_tailserve_order(fcfs).order != [w.request_id for w in waiting]  # fcfs does sort


def test_bad_policy_is_a_one_line_error():
    with pytest.raises(ValueError, match="policy must be one of"):
        OrderCase("sjf", cached=[])


live = pytest.mark.skipif(
    peer_python("sglang") is None, reason="no SGLang peer venv (scripts/setup-peers.sh sglang)"
)


@pytest.mark.differential
@live
def test_live_random_orders_are_identical():
    with PeerDriver("sglang") as driver:
        bad = []
        for seed in range(50_000, 50_200):
            case = random_order_case(seed)
            theirs = OrderResult.from_dict(driver.run_raw(case.to_dict()))
            if (d := describe_difference(run_tailserve_order(case), theirs)) is not None:
                bad.append((seed, d))
    assert not bad, f"{len(bad)} of 200 differ; first: seed {bad[0][0]}: {bad[0][1]}"
