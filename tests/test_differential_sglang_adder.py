"""tailserve's ``sglang`` policy against SGLang 0.5.23's own ``PrefillAdder``: whole prefill passes.

``fixtures/differential/sglang_adder.json`` holds SGLang's decisions for seeded random scheduler
states (ordering, admissions with their extend and prefix tokens, the chunked request, priority
preemption victims, ``batch_is_full``), recorded by ``python -m benchmarks.differential --engine
sglang-adder -k 300 --fixture-identical-only --record-fixture ...``; the live check is
``-m differential``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tailserve.validate.golden import load_fixture
from tailserve.validate.peers import PeerDriver, peer_python
from tailserve.validate.sglang_pass import (
    PASS_POLICIES,
    PassCase,
    PassResult,
    describe_pass_difference,
    random_pass_case,
    run_tailserve_pass,
)

FIXTURE = Path(__file__).parent / "fixtures" / "differential" / "sglang_adder.json"


@pytest.fixture(scope="module")
def cases() -> list[tuple[PassCase, PassResult]]:
    golden = load_fixture(FIXTURE)
    assert golden["engine"] == "sglang-adder" and golden["version"] == "0.5.23"
    return [(PassCase.from_compact(e["case"]), PassResult(**e["result"])) for e in golden["workloads"]]


def test_golden_prefill_passes_are_identical(cases):
    assert len(cases) >= 200
    bad = [
        (c.seed, d) for c, theirs in cases if (d := describe_pass_difference(run_tailserve_pass(c), theirs))
    ]
    assert not bad, f"{len(bad)} of {len(cases)} differ; first: seed {bad[0][0]}: {bad[0][1]}"


def test_golden_covers_admission_chunking_and_preemption(cases):
    assert {c.schedule_policy for c, _ in cases} == set(PASS_POLICIES)
    results = [r for _, r in cases]
    assert sum(len(r.can_run) for r in results) >= 150
    assert any(r.new_chunked for r in results)  # a request cut into a chunk
    assert any(
        c.chunked is not None and r.can_run and r.can_run[0][0] == c.chunked.request_id for c, r in cases
    )
    assert sum(bool(r.preempted) for r in results) >= 10  # priority preemption happened
    assert any(r.batch_is_full for r in results) and not all(r.batch_is_full for r in results)
    assert any(prefix > 0 for r in results for _, _, prefix in r.can_run)  # radix hits at admission
    assert any(c.enable_mixed_chunk and c.running and r.can_run for c, r in cases)


def test_golden_check_catches_the_old_preemption_need(cases):
    """tailserve's earlier rule charged a waiting request its whole prompt when asking for
    preemption; SGLang charges only what its last look left (nothing for a fresh request)."""
    fresh = [
        (replace(c, waiting=[replace(w, stale_fill_len=len(w.prompt_token_ids)) for w in c.waiting]), r)
        for c, r in cases
        if r.preempted
    ]
    assert any(describe_pass_difference(run_tailserve_pass(c), r) for c, r in fresh)


live = pytest.mark.skipif(
    peer_python("sglang-adder") is None, reason="no SGLang peer venv (scripts/setup-peers.sh sglang)"
)


@pytest.mark.differential
@live
def test_live_random_prefill_passes_are_identical():
    with PeerDriver("sglang-adder") as driver:
        bad = []
        for seed in range(60_000, 60_300):
            case = random_pass_case(seed)
            theirs = PassResult.from_engine(driver.run_raw(case.to_dict()))
            if theirs.engine_fails:
                continue  # a state SGLang itself cannot run past (docs/validation.md)
            if (d := describe_pass_difference(run_tailserve_pass(case), theirs)) is not None:
                bad.append((seed, d))
    assert not bad, f"{len(bad)} of 300 differ; first: seed {bad[0][0]}: {bad[0][1]}"
