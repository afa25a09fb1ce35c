"""tailserve's SGLang decode server against SGLang 0.5.23's own ``DecodePreallocQueue``: which
retracted requests a turn restores and which queued requests it pre-allocates.

``fixtures/differential/sglang_prealloc.json`` holds SGLang's answers for 600 seeded random
decode-server states, recorded by ``python -m benchmarks.differential --engine sglang-prealloc -k
600 --record-fixture ...`` (all 2,000 of a live run were identical; 40% of the states under the
``prefill_complete`` allocation policy since r55); the live check is ``-m differential``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tailserve.policies.sglang_decode import SglangDecodePolicy
from tailserve.validate.golden import load_fixture
from tailserve.validate.peers import PeerDriver, peer_python
from tailserve.validate.sglang_prealloc import (
    PreallocCase,
    PreallocResult,
    describe_prealloc_difference,
    random_prealloc_case,
    run_tailserve_prealloc,
)

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "sglang_prealloc.json"


@pytest.fixture(scope="module")
def cases() -> list[tuple[PreallocCase, PreallocResult]]:
    golden = load_fixture(FIXTURE)
    assert golden["engine"] == "sglang-prealloc" and golden["version"] == "0.5.23"
    return [(PreallocCase.from_dict(e["case"]), PreallocResult(**e["result"])) for e in golden["workloads"]]


def test_golden_turns_are_identical(cases):
    assert len(cases) == 600
    bad = [
        (c.seed, d)
        for c, theirs in cases
        if (d := describe_prealloc_difference(run_tailserve_prealloc(c), theirs))
    ]
    assert not bad, f"{len(bad)} of {len(cases)} differ; first: seed {bad[0][0]}: {bad[0][1]}"


def test_golden_covers_restores_admissions_and_stops(cases):
    results = [r for _, r in cases]
    assert sum(len(r.preallocated) for r in results) >= 250
    assert sum(len(r.resumed) for r in results) >= 50
    # a pass that stopped with requests still queued, and one with a retraction left waiting
    assert any(len(r.preallocated) < len(c.queue) and not c.retracted for c, r in cases)
    assert any(c.retracted and len(r.resumed) < len(c.retracted) for c, r in cases)
    assert any(c.num_reserved_decode_tokens == 0 for c, _ in cases)
    # prefill_complete: turns that passed over a request whose prefill was not done, and placed
    # one behind it
    assert sum(c.not_ready is not None for c, _ in cases) >= 150
    passed_over = 0
    for c, r in cases:
        ids = [row[0] for row in c.queue]
        passed_over += any(
            rid in (c.not_ready or ()) and any(x in r.preallocated for x in ids[i + 1 :])
            for i, rid in enumerate(ids)
        )
    assert passed_over >= 10


def test_golden_check_catches_a_prefill_not_done_blocking_the_pass(cases, monkeypatch):
    """``prefill_complete``: a request whose prefill is not done is passed over (SGLang's
    ``if not decode_req.waiting_for_input: continue``); stopping the pass there differs."""
    original = SglangDecodePolicy._pop_preallocated

    def blocking(self, sched, now):
        if self.deferred:
            waiting = list(sched.waiting)
            first = next(
                (i for i, r in enumerate(waiting) if self.prefilled.get(r.request_id, now + 1) > now), None
            )
            if first is not None:
                for r in waiting[first:]:
                    self.prefilled.pop(r.request_id, None)  # nobody at or behind it is taken
        return original(self, sched, now)

    monkeypatch.setattr(SglangDecodePolicy, "_pop_preallocated", blocking)
    assert any(describe_prealloc_difference(run_tailserve_prealloc(c), theirs) for c, theirs in cases)


def test_golden_check_catches_a_reserve_left_out(cases, monkeypatch):
    """Leave the arrived requests (KV here, not running yet) out of the reserve: some turns
    differ from SGLang's."""
    budget = SglangDecodePolicy._budget

    def without_arrived(self, sched, extra, retractable):
        return budget(self, sched, extra - len(self.arrived), retractable)

    monkeypatch.setattr(SglangDecodePolicy, "_budget", without_arrived)
    assert any(describe_prealloc_difference(run_tailserve_prealloc(c), theirs) for c, theirs in cases)


@pytest.mark.differential
def test_live_turns_are_identical():
    if peer_python("sglang-prealloc") is None:
        pytest.skip("no sglang peer venv: scripts/setup-peers.sh sglang")
    with PeerDriver("sglang-prealloc") as driver:
        for seed in range(200):
            case = random_prealloc_case(seed)
            theirs = PreallocResult(**driver.run_raw(case.to_dict()))
            assert describe_prealloc_difference(run_tailserve_prealloc(case), theirs) is None, seed
