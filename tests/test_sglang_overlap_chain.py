"""SGLang's overlap scheduler through the two shortcuts of ``async_decode_run.py`` that only it
signs: a run that starts with a prefill batch in flight (``FastPaths.async_run_after_prefill``:
with nobody waiting, the turn after a prefill batch decodes the whole running batch, the new
requests on the placeholders of their first tokens, the others one step behind them), and a
chain of runs in one call (``FastPaths.async_runs_chain``: a run ending with its skipping step
goes on into the next, the requests that stay running updated once, at the end). The results
are stepping's, request for request and iteration for iteration, where each is taken: arrivals
between the runs, finishes with ties, KV slots running out inside a chain, closed-loop clients
released by a chain's finishes, tenants in VTC order, host parts longer than the forward
passes; each shortcut turned off changes nothing; the other policies sign neither."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tailserve.executors.simulated import async_decode_run
from tailserve.executors.simulated.fast_paths import FastPaths
from tailserve.policies.registry import POLICIES
from tailserve.policies.sglang import SglangPolicy
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import LogNormal
from test_speed_paths import BURSTY, SPARSE, _assert_same, _async_fingerprint

SG = "sglang"
# Forty requests at once, long outputs, a pool that holds them only just: the chain's last runs
# stop where the free slots run out (and the step after them retracts), with nobody waiting.
CROWDED = WorkloadSpec(
    "random",
    num_requests=40,
    rate=200.0,
    seed=31,
    input_len=LogNormal(300, 0.5, 1200),
    output_len=LogNormal(1200, 0.4, 3000),
)
CASES = [
    (SG, SPARSE, None),
    (SG, BURSTY, None),
    (f"{SG},disable_radix_cache=true", replace(BURSTY, seed=41), None),
    (f"{SG},gpu_memory_utilization=0.25", CROWDED, None),
    # Short outputs: a prefill batch whose first tokens are their last (skipped at once).
    (SG, replace(BURSTY, seed=42, output_len=LogNormal(3, 0.8, 12)), None),
    # Closed-loop clients: a chain's finish releases the next request, which ends the chain.
    (SG, replace(SPARSE, num_requests=80, arrival=ArrivalSpec("closed", concurrency=12)), None),
    (
        f"{SG},fairness=vtc,gpu_memory_utilization=0.3",
        replace(BURSTY, seed=43, tenants=(("a", 0.7), ("b", 0.3))),
        None,
    ),
    # Forward passes shorter than the host part: the recurrence's other branch.
    (SG, replace(SPARSE, seed=44), 0.012),
]


def _count_shortcuts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Runs that started with a prefill batch in flight, chains, and skipping steps a chain took
    after its first run's."""
    counts = {"after_prefill": 0, "chains": 0, "chained_skips": 0}
    advance = async_decode_run.advance_async_decode_run
    chain = async_decode_run._chain
    price = async_decode_run._price_skip
    inside = [False]

    def advancing(engine):
        behind = len(engine.scheduler.running) - len(engine.in_flight.out.scheduled)
        steps = advance(engine)
        counts["after_prefill"] += bool(behind and steps)
        return steps

    def chaining(*args):
        counts["chains"] += 1
        inside[0] = True
        try:
            return chain(*args)
        finally:
            inside[0] = False

    def pricing(*args):
        step = price(*args)
        counts["chained_skips"] += inside[0] and step is not None
        return step

    monkeypatch.setattr(async_decode_run, "advance_async_decode_run", advancing)
    monkeypatch.setattr(async_decode_run, "_chain", chaining)
    monkeypatch.setattr(async_decode_run, "_price_skip", pricing)
    return counts


@pytest.mark.parametrize("spec, workload, overhead", CASES)
def test_shortcuts_identical_to_plain_stepping(
    monkeypatch: pytest.MonkeyPatch, spec: str, workload: WorkloadSpec, overhead
) -> None:
    counts = _count_shortcuts(monkeypatch)
    fast, _ = _async_fingerprint(spec, workload, True, overhead)
    slow, _ = _async_fingerprint(spec, workload, False, overhead)
    _assert_same(fast, slow)
    assert counts["after_prefill"] and counts["chains"], counts


def test_the_cases_reach_what_they_are_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chains go on past their first run (BURSTY drains its burst in one chain of ~100
    runs, SPARSE's are cut by arrivals), and the crowded pool retracts (the step after a
    chain's slots ran out)."""
    counts = _count_shortcuts(monkeypatch)
    _async_fingerprint(SG, BURSTY, True)
    assert counts["chained_skips"] > 50, counts
    counts.update(chains=0, chained_skips=0)
    _async_fingerprint(SG, SPARSE, True)
    assert counts["chains"] > 5 and counts["chained_skips"] > counts["chains"], counts
    _, run = _async_fingerprint(f"{SG},gpu_memory_utilization=0.25", CROWDED, True)
    assert sum(r.num_preemptions for r in run.requests) > 0


@pytest.mark.parametrize("flag", ["async_run_after_prefill", "async_runs_chain"])
def test_each_shortcut_off_changes_nothing(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """Unsigned, the shortcut is not taken (the state it starts from is stepped, or each run is
    its own call) and the results are the same."""
    on, _ = _async_fingerprint(SG, replace(BURSTY, seed=45), True)
    monkeypatch.setattr(SglangPolicy, flag, False)
    counts = _count_shortcuts(monkeypatch)
    off, _ = _async_fingerprint(SG, replace(BURSTY, seed=45), True)
    _assert_same(off, on)
    taken = counts["after_prefill"] if flag == "async_run_after_prefill" else counts["chains"]
    assert taken == 0


def test_only_sglang_signs_them() -> None:
    """vLLM and TensorRT-LLM schedule the running decodes beside every prefill, and their KV
    blocks hold several tokens: neither state arises, and the defaults say no."""
    assert not FastPaths.async_run_after_prefill and not FastPaths.async_runs_chain
    for name, cls in POLICIES.items():
        if issubclass(cls, SglangPolicy):
            continue
        assert not getattr(cls, "async_run_after_prefill", False), name
        assert not getattr(cls, "async_runs_chain", False), name
