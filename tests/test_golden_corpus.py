"""Golden corpus (issue 13): every policy's saved run, and the real executor's greedy tokens, are
byte-identical to what the reference commit recorded (tests/golden/corpus.py says what runs).

A difference here is a behaviour change. If it is intended (a fidelity fix), say so in the commit
and re-record with ``python -m tests.golden.record --only CASE``; a refactor never re-records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.golden import corpus

GOLDEN = json.loads(corpus.FIXTURE.read_text())
SIM_CASES = corpus.sim_cases()


def test_every_case_is_recorded():
    names = {c.name for c in SIM_CASES}
    assert names == set(GOLDEN["sim"]) or names - set(GOLDEN["sim"]) <= {
        c.name for c in SIM_CASES if c.needs_trace
    }
    assert {name for name, *_ in corpus.TORCH_POLICIES} == set(GOLDEN["torch"])


@pytest.mark.parametrize("case", SIM_CASES, ids=[c.name for c in SIM_CASES])
def test_simulated_run_is_unchanged(case):
    if case.needs_trace and corpus.find_trace(case.needs_trace) is None:
        pytest.skip(f"the shared trace {case.needs_trace} (../shared/traces) is not present")
    expected = GOLDEN["sim"][case.name]
    got = corpus.run_sim_case(case)
    # The figures first, so a failure says where the runs part (requests, log or batches).
    figures = ("num_requests", "num_iterations", "num_preemptions", "last_finish")
    assert {k: got[k] for k in figures} == {k: expected[k] for k in figures}
    for part in ("requests", "iteration_log", "batches", "sha256"):
        assert got[part] == expected[part], f"{case.name}: {part} differ"


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory) -> Path:
    return corpus.torch_model_dir(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize(
    "name,policy,flags,pressure", corpus.TORCH_POLICIES, ids=[c[0] for c in corpus.TORCH_POLICIES]
)
def test_real_executor_tokens_are_unchanged(golden_model, name, policy, flags, pressure):
    got = corpus.run_torch_case(golden_model, policy, flags, pressure)
    assert got == GOLDEN["torch"][name]
