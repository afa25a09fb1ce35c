"""SGLang's overlap scheduler (its default) through the async decode run
(``executors/simulated/async_decode_run.py``): the driver's results are stepping's, request for
request and iteration for iteration, on short and long prompts, with requests waiting behind the
running cap or the KV budget, retraction, the radix cache with shared prefixes, multi-turn
sessions, priorities, tenants in VTC order and per-step host times longer than the forward
passes; the run is taken; and where ``can_fast_forward`` says no, taking it would change them."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tailserve.policies.sglang import SglangPolicy
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import LogNormal
from test_speed_paths import (
    BURSTY,
    LONG_PROMPTS,
    SHARED_PROMPTS,
    SPARSE,
    _assert_same,
    _async_fingerprint,
    count_async_runs,
)

SG = "sglang"  # SGLang's defaults: the overlap scheduler on, the radix cache on
# Long outputs at a high rate in a small pool: the decaying ratio admits more than fits, retraction.
RETRACTING = replace(BURSTY, seed=13, rate=40.0, output_len=LogNormal(800, 0.5, 3000))
SG_CASES = [
    (SG, BURSTY, None),
    (SG, SPARSE, None),  # long runs (numpy) and their skipping steps
    (f"{SG},disable_radix_cache=true", replace(BURSTY, seed=12), None),
    # KV pressure: retraction (its in-flight output dropped), waiting heads blocked by the budget.
    (f"{SG},gpu_memory_utilization=0.25", RETRACTING, None),
    (f"{SG},gpu_memory_utilization=0.25,disable_radix_cache=true", replace(RETRACTING, seed=14), None),
    # The running cap: a queue waits behind ``batch_is_full``.
    (f"{SG},max_running_requests=6", replace(BURSTY, seed=15), None),
    (f"{SG},max_running_requests=4,gpu_memory_utilization=0.25", replace(RETRACTING, seed=16), None),
    # Long prompts: chunked requests (stepped) between runs; without chunking.
    (f"{SG},chunked_prefill_size=512", LONG_PROMPTS, None),
    (f"{SG},chunked_prefill_size=-1", replace(LONG_PROMPTS, seed=7), None),
    (f"{SG},enable_mixed_chunk=true,chunked_prefill_size=512", replace(LONG_PROMPTS, seed=8), None),
    # The radix cache with token ids: shared prefixes matched, checkpointed, evicted.
    (SG, SHARED_PROMPTS, None),
    (f"{SG},gpu_memory_utilization=0.25", replace(SHARED_PROMPTS, seed=5, rate=20.0), None),
    (f"{SG},schedule_policy=lpm,max_running_requests=8", replace(SHARED_PROMPTS, seed=6, rate=20.0), None),
    (
        SG,
        WorkloadSpec("multi-turn", num_sessions=30, rate=4.0, seed=2, think_time=0.5, system_prompt_len=900),
        None,
    ),
    (
        f"{SG},gpu_memory_utilization=0.25",
        WorkloadSpec("multi-turn", num_sessions=40, rate=8.0, seed=3, think_time=0.2),
        None,
    ),
    # Priorities: with preemption (a prefill tried every turn while requests wait) and without.
    (
        f"{SG},enable_priority_scheduling=true,gpu_memory_utilization=0.25",
        replace(RETRACTING, seed=18, priorities=((0, 0.3), (1, 0.4), (5, 0.3))),
        None,
    ),
    (
        f"{SG},enable_priority_scheduling=true,disable_priority_preemption=true,max_running_requests=6",
        replace(BURSTY, seed=19, priorities=((0, 0.5), (3, 0.5))),
        None,
    ),
    # Closed-loop clients: each finish releases the next request at once.
    (SG, replace(SPARSE, num_requests=80, arrival=ArrivalSpec("closed", concurrency=12)), None),
    # Tenants in VTC order in front of the policy.
    (
        f"{SG},fairness=vtc,gpu_memory_utilization=0.3",
        replace(BURSTY, seed=21, tenants=(("a", 0.7), ("b", 0.3))),
        None,
    ),
    # Forward passes shorter than the host part: the recurrence's other branch.
    (SG, replace(SPARSE, seed=4), 0.012),
    (f"{SG},gpu_memory_utilization=0.25", replace(RETRACTING, seed=20), 0.009),
]


@pytest.mark.parametrize("spec, workload, overhead", SG_CASES)
def test_sglang_overlap_run_identical_to_plain_stepping(spec: str, workload: WorkloadSpec, overhead) -> None:
    fast, fast_run = _async_fingerprint(spec, workload, True, overhead)
    slow, slow_run = _async_fingerprint(spec, workload, False, overhead)
    assert len(fast_run.log) == len(slow_run.log) > len(slow_run.requests)
    _assert_same(fast, slow, spec)


def test_the_cases_reach_what_they_are_about() -> None:
    """Retraction, the radix cache's hits and the running cap happen in the cases above."""
    _, run = _async_fingerprint(f"{SG},gpu_memory_utilization=0.25", RETRACTING, True)
    assert sum(r.num_preemptions for r in run.requests) > 0
    _, run = _async_fingerprint(SG, SHARED_PROMPTS, True)
    assert sum(r.num_cached_tokens for r in run.requests) > 0
    _, run = _async_fingerprint(f"{SG},max_running_requests=6", replace(BURSTY, seed=15), True)
    assert max(run.log.batch_size) == 6
    assert max(r.first_scheduled_time - r.arrival_time for r in run.requests) > 0.1


@pytest.mark.parametrize("seed", range(8))
def test_sglang_overlap_run_identical_over_seeds(seed: int) -> None:
    """Random mixes of the cases' knobs, one per seed."""
    rng = random.Random(seed)
    flags = [SG]
    if rng.random() < 0.5:
        flags.append(f"gpu_memory_utilization={rng.choice([0.25, 0.3, 0.5])}")
    if rng.random() < 0.3:
        flags.append("disable_radix_cache=true")
    if rng.random() < 0.3:
        flags.append(f"chunked_prefill_size={rng.choice([256, 1024, 2048])}")
    if rng.random() < 0.3:
        flags.append(f"max_running_requests={rng.choice([4, 16, 64])}")
    kind = rng.choice(["random", "random", "shared-prefix"])
    workload = WorkloadSpec(
        kind,
        num_requests=rng.randint(40, 120),
        rate=rng.choice([1.0, 5.0, 20.0, 60.0]),
        seed=200 + seed,
        input_len=LogNormal(rng.choice([200, 800, 2000]), 1.0, 6000),
        output_len=LogNormal(rng.choice([1, 20, 150, 500]), 0.9, 1500),
        arrival=ArrivalSpec("gamma", burstiness=rng.choice([0.3, 1.0, 3.0])),
    )
    overhead = rng.choice([None, None, 0.004, 0.01])
    spec = ",".join(flags)
    fast, _ = _async_fingerprint(spec, workload, True, overhead)
    slow, _ = _async_fingerprint(spec, workload, False, overhead)
    _assert_same(fast, slow, f"{spec} {workload}")


def test_sglang_overlap_takes_the_async_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most steps are advanced in runs, some longer than ``SHORT_RUN`` (numpy), and runs end
    with the step that skips the requests whose last token is in flight; the synchronous runs
    never start under overlap; with speculative decoding the policy declines (drafts step)."""
    from tailserve.executors.simulated import async_decode_run, chunk_run, prefill_run

    calls, skips = count_async_runs(monkeypatch)
    monkeypatch.setattr(chunk_run, "advance_chunk_run", lambda engine: pytest.fail("a chunk run"))
    monkeypatch.setattr(prefill_run, "advance_lone_chunk_run", lambda engine: pytest.fail("a lone chunk run"))
    _, run = _async_fingerprint(SG, SPARSE, True)
    assert sum(calls) > 0.8 * len(run.log)
    assert max(calls) > async_decode_run.SHORT_RUN and sum(skips) > 20
    calls.clear()
    spec = f"{SG},speculative_algorithm=EAGLE,speculative_num_steps=2,synthetic_acceptance_length=2"
    _async_fingerprint(spec, SPARSE, True)
    assert not calls


def test_steady_after_run_agrees_with_steady(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between back-to-back async runs the driver asks ``steady_after_run``, which skips the
    batch scans: at every such call it must answer what the full ``steady`` answers."""
    from tailserve.executors.simulated import async_decode_run

    answers: list[bool] = []
    original = async_decode_run.steady_after_run

    def checked(engine) -> bool:
        short = original(engine)
        assert short == async_decode_run.steady(engine)
        answers.append(short)
        return short

    monkeypatch.setattr(async_decode_run, "steady_after_run", checked)
    for spec, workload in [(SG, BURSTY), (f"{SG},max_running_requests=6", replace(BURSTY, seed=15))]:
        fast, _ = _async_fingerprint(spec, workload, True)
        slow, _ = _async_fingerprint(spec, workload, False)
        _assert_same(fast, slow, spec)
    assert True in answers and False in answers  # both ways taken


def test_a_run_where_the_queue_would_be_walked_changes_the_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparisons above catch a run taken where it is not exact. With priority preemption
    on, every turn walks the waiting queue (``batch_is_full`` cleared first), and a request
    blocked by the KV budget gets in once the decaying ratio frees enough of it: a
    ``can_fast_forward`` that lets a run decode on with requests waiting behind a full batch
    (as it may without preemption) differs from stepping."""

    def without_preemption(self, sched) -> bool:
        return self.chunked is None and self.spec is None and (not sched.waiting or self.batch_is_full)

    spec = f"{SG},enable_priority_scheduling=true,gpu_memory_utilization=0.25"
    workload = replace(RETRACTING, seed=18, priorities=((0, 0.3), (1, 0.4), (5, 0.3)))
    slow, _ = _async_fingerprint(spec, workload, False)
    fast, _ = _async_fingerprint(spec, workload, True)
    assert fast == slow
    monkeypatch.setattr(SglangPolicy, "can_fast_forward", without_preemption)
    wrong, _ = _async_fingerprint(spec, workload, True)
    assert wrong != slow


def _rows(batches) -> list:
    """The batch record one row per iteration (a run's entry holds several)."""
    rows = []
    for e in batches.entries:
        for j, (start, duration, used) in enumerate(zip(e.starts, e.durations, e.num_used_blocks)):
            contexts = [c + j for c in e.num_context_tokens]
            rows.append((start, duration, e.request_ids, e.num_new_tokens, contexts, used, e.waiting_head))
    return rows


def test_batch_record_per_iteration_identical_and_saved_runs_kept_stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With integrity checks after every run and the batch record: the async run gives the same
    run, and records one entry per step, the entries stepping records (the golden corpus's saved
    runs hold those: ``SglangPolicy.batch_entry_per_async_run``); grouped, the same rows per
    iteration in fewer entries."""
    calls, _ = count_async_runs(monkeypatch)
    spec, workload = f"{SG},gpu_memory_utilization=0.25", replace(RETRACTING, seed=22)
    options = {"check_integrity": True, "record_batches": True}
    slow, slow_run = _async_fingerprint(spec, workload, False, **options)
    per_step, per_step_run = _async_fingerprint(spec, workload, True, **options)
    assert sum(calls) > len(slow_run.log) / 2  # the run was taken
    _assert_same(per_step, slow)
    assert [e.to_json() for e in per_step_run.batches.entries] == [
        e.to_json() for e in slow_run.batches.entries
    ]
    monkeypatch.setattr(SglangPolicy, "batch_entry_per_async_run", True)
    grouped, grouped_run = _async_fingerprint(spec, workload, True, **options)
    _assert_same(grouped, slow)
    assert _rows(grouped_run.batches) == _rows(slow_run.batches)
    assert len(grouped_run.batches.entries) < len(slow_run.batches.entries)


def test_sglang_overlap_run_in_a_cluster_identical_to_plain_stepping(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica's run stops at the cluster's next event (its source's next arrival)."""
    from tailserve.cluster.build import build_stage, workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.spec import replicated
    from tailserve.core.engine import EngineOptions
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.workload_builder import WorkloadBuilder

    deployment = Deployment("Llama-3-8B", "A100-80GB", 1, "none")
    workload = WorkloadBuilder(replace(BURSTY, num_requests=100))

    def tokens(fast: bool) -> dict:
        specs = replicated(2, deployment, PolicySpec.make("sglang", {}))
        stage = build_stage(
            specs, "least-requests", shares_prefixes=False, options=EngineOptions(fast_forward=fast)
        )
        run = run_aggregated(stage, workload_requests(workload, specs))
        return {r.request_id: (r.token_times, r.enqueue_time, r.status.name) for r in run.requests}

    calls, _ = count_async_runs(monkeypatch)
    assert tokens(True) == tokens(False)
    assert sum(calls) > 100  # the replicas took runs


def test_one_token_slots_need_what_the_numpy_path_counts() -> None:
    """``_short_need``'s running count for one-token slots (SGLang's) is ``_long_need``'s."""
    from tailserve.executors.simulated.async_decode_run import _long_need, _short_need

    rng = random.Random(1)
    for _ in range(2000):
        n, k = rng.randint(1, 40), rng.randint(1, 32)
        first_new = [rng.randint(0, 40) for _ in range(n)]
        ctx = [rng.randint(1, 5000) for _ in range(n)]
        free = rng.randint(0, 400)
        assert _short_need(first_new, 1, free, k) == _long_need(ctx, first_new, 1, free, k)


def test_fairness_wrapped_sglang_records_one_entry_per_step_too() -> None:
    """``fairness=vtc`` wraps the policy (``FairPolicy``), which carries ``FastPaths``' class
    declarations over: the wrapped SGLang's runs are recorded one entry per step as well."""
    spec = f"{SG},fairness=vtc,gpu_memory_utilization=0.3"
    workload = replace(BURSTY, seed=23, tenants=(("a", 0.7), ("b", 0.3)))
    options = {"record_batches": True}
    slow, slow_run = _async_fingerprint(spec, workload, False, **options)
    fast, fast_run = _async_fingerprint(spec, workload, True, **options)
    _assert_same(fast, slow)
    assert [e.to_json() for e in fast_run.batches.entries] == [e.to_json() for e in slow_run.batches.entries]
