"""TensorRT-LLM's overlap scheduler with a blocked queue head: the async decode run goes on across
arrivals (``TrtllmPolicy.arrivals_wait_in_async_runs``, ``async_decode_run.takes_arrivals``),
adding each at the first step scheduled at or after it, with results identical to stepping —
heads blocked by ``max_num_tokens`` and by GUARANTEED_NO_EVICT's reservations, arrivals rejected
at the door, closed-loop clients (a rejection releases the next request), block reuse, a cluster
replica (its source's horizon still ends the run); loosening the rules for a released arrival
or the horizon changes the results."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tailserve.executors.simulated import async_decode_run
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import LogNormal
from test_speed_paths import SHARED_PROMPTS, _assert_same, _async_fingerprint

# Prompts near max_num_tokens at a rate the decodes cannot drain: the head context waits for the
# budget the decodes leave; some prompts pass it (rejected at arrival).
QUEUED = WorkloadSpec(
    "random",
    num_requests=150,
    rate=12.0,
    seed=31,
    input_len=LogNormal(1400, 0.6, 3000),
    output_len=LogNormal(300, 0.7, 1500),
)
TIGHT = "trtllm:max_num_tokens=2048"
# Closed-loop clients, more than the budget admits: a rejected request (its prompt past
# max_num_tokens) releases the next one while a run's step adds its arrivals.
CLOSED = replace(
    QUEUED,
    seed=37,
    num_requests=200,
    input_len=LogNormal(1600, 0.5, 3000),
    arrival=ArrivalSpec("closed", concurrency=80),
)
CASES = [
    (TIGHT, QUEUED),
    (TIGHT, replace(QUEUED, seed=32, rate=20.0, arrival=ArrivalSpec("gamma", burstiness=0.4))),
    # GUARANTEED_NO_EVICT's reservations: a small pool blocks the head by KV.
    ("trtllm:gpu_memory_utilization=0.2", replace(QUEUED, seed=33, input_len=LogNormal(900, 0.8, 6000))),
    ("trtllm:capacity_scheduler_policy=STATIC_BATCH,max_num_tokens=4096", replace(QUEUED, seed=34)),
    ("trtllm:max_batch_size=8", replace(QUEUED, seed=35, input_len=LogNormal(300, 0.8, 1500))),
    # Block reuse with shared prefixes: the reuse rule's skips.
    (
        "trtllm:max_num_tokens=1536",
        replace(
            SHARED_PROMPTS,
            seed=36,
            rate=40.0,
            input_len=LogNormal(1200, 0.5, 3000),
            output_len=LogNormal(300, 0.7, 1500),
        ),
    ),
    (TIGHT, CLOSED),
]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The arrivals added inside runs."""
    added: list[int] = []
    original = async_decode_run._add_arrivals

    def counting(engine, scheduled_at) -> None:
        before = engine.num_requests_seen
        original(engine, scheduled_at)
        added.append(engine.num_requests_seen - before)

    monkeypatch.setattr(async_decode_run, "_add_arrivals", counting)
    return added


@pytest.mark.parametrize("spec, workload", CASES)
def test_runs_across_arrivals_identical_to_stepping(
    monkeypatch: pytest.MonkeyPatch, spec: str, workload: WorkloadSpec
) -> None:
    added = _counting(monkeypatch)
    fast, _ = _async_fingerprint(spec, workload, True)
    slow, _ = _async_fingerprint(spec, workload, False)
    _assert_same(fast, slow, spec)
    assert sum(added) > 0  # arrivals were added inside runs


@pytest.mark.parametrize("seed", [1, 2, 8, 9, 15, 18, 21, 27])
def test_random_mixes_identical_to_stepping(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Random mixes of the knobs (seeds where runs take arrivals; 270 seeds passed when added)."""
    rng = random.Random(seed)
    flags = []
    if rng.random() < 0.7:
        flags.append(f"max_num_tokens={rng.choice([1024, 2048, 4096])}")
    if rng.random() < 0.4:
        flags.append(f"gpu_memory_utilization={rng.choice([0.15, 0.25, 0.5])}")
    if rng.random() < 0.3:
        flags.append(f"max_batch_size={rng.choice([4, 16, 64])}")
    if rng.random() < 0.2:
        flags.append("capacity_scheduler_policy=STATIC_BATCH")
    if rng.random() < 0.2:
        flags.append("enable_block_reuse=false")
    spec = "trtllm" + (":" + ",".join(flags) if flags else "")
    kind = rng.choice(["random", "random", "shared-prefix"])
    arrival = rng.choice(
        [
            ArrivalSpec("gamma", burstiness=rng.choice([0.3, 1.0, 3.0])),
            ArrivalSpec("closed", concurrency=rng.choice([8, 40, 100])),
        ]
    )
    workload = WorkloadSpec(
        kind,
        num_requests=rng.randint(60, 160),
        rate=rng.choice([5.0, 20.0, 60.0]),
        seed=300 + seed,
        input_len=LogNormal(rng.choice([300, 900, 1600]), rng.choice([0.5, 1.0]), 6000),
        output_len=LogNormal(rng.choice([20, 150, 500]), 0.8, 1500),
        arrival=arrival,
    )
    overhead = rng.choice([None, None, 0.004, 0.01])
    added = _counting(monkeypatch)
    fast, _ = _async_fingerprint(spec, workload, True, overhead)
    slow, _ = _async_fingerprint(spec, workload, False, overhead)
    _assert_same(fast, slow, f"{spec} {workload}")
    assert sum(added) > 0


def test_the_cases_reach_rejections_and_kv_blocked_heads() -> None:
    _, run = _async_fingerprint(TIGHT, QUEUED, True)
    assert any(r.status.name == "FINISHED_REJECTED" for r in run.requests)
    assert max(r.first_scheduled_time - r.arrival_time for r in run.requests if r.first_scheduled_time) > 1.0


@pytest.mark.parametrize(
    "spec",
    [
        "trtllm:capacity_scheduler_policy=MAX_UTILIZATION,max_num_tokens=2048",
        "trtllm:enable_chunked_prefill=true,max_num_tokens=2048",
        "trtllm:max_num_tokens=2048,disable_overlap_scheduler=true",
    ],
)
def test_the_policy_says_no_outside_its_proof(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    """MAX_UTILIZATION (its pass may pause) and chunked prefill (a short arrival can take a chunk
    of the budget the head's rounds to nothing) step at arrivals, as without overlap (no async
    run at all)."""
    added = _counting(monkeypatch)
    fast, _ = _async_fingerprint(spec, QUEUED, True)
    slow, _ = _async_fingerprint(spec, QUEUED, False)
    _assert_same(fast, slow, spec)
    assert not added


def test_an_arrival_released_while_a_step_adds_its_own_waits_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A closed-loop client's request released by a rejection at a step's ``add_arrivals`` joins
    at the next step, as stepping adds it: adding it in the same step (the search not moved past
    that step) changes the results."""
    from bisect import bisect_left

    slow, _ = _async_fingerprint(TIGHT, CLOSED, False)
    fast, _ = _async_fingerprint(TIGHT, CLOSED, True)
    _assert_same(fast, slow)

    def same_step(engine, scheduled_at) -> None:
        source = engine.source
        i = 0
        nxt = source.next_arrival_time()
        while nxt is not None:
            i = bisect_left(scheduled_at, nxt, i)
            if i == len(scheduled_at):
                return
            engine.add_arrivals(scheduled_at[i])
            nxt = source.next_arrival_time()

    monkeypatch.setattr(async_decode_run, "_add_arrivals", same_step)
    wrong, _ = _async_fingerprint(TIGHT, CLOSED, True)
    assert wrong != slow


def test_a_batch_record_keeps_the_arrival_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its entries name the queue after each step: no arrivals inside runs, same rows."""
    added = _counting(monkeypatch)
    fast, _ = _async_fingerprint(TIGHT, QUEUED, True, record_batches=True)
    slow, _ = _async_fingerprint(TIGHT, QUEUED, False, record_batches=True)
    _assert_same(fast, slow)
    assert not added


def test_a_cluster_replica_stops_at_its_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    from tailserve.cluster.build import build_stage, workload_requests
    from tailserve.cluster.cluster import run_aggregated
    from tailserve.cluster.spec import replicated
    from tailserve.core.engine import EngineOptions
    from tailserve.executors.simulated.deployment import Deployment
    from tailserve.policies.registry import PolicySpec
    from tailserve.sim.workload_builder import WorkloadBuilder

    deployment = Deployment("Llama-3-8B", "A100-80GB", 1, "none")
    workload = WorkloadBuilder(replace(QUEUED, num_requests=100, rate=20.0))

    def tokens(fast: bool) -> dict:
        specs = replicated(2, deployment, PolicySpec.make("trtllm", {"max_num_tokens": "2048"}))
        stage = build_stage(
            specs, "least-requests", shares_prefixes=False, options=EngineOptions(fast_forward=fast)
        )
        run = run_aggregated(stage, workload_requests(workload, specs))
        return {r.request_id: (r.token_times, r.enqueue_time, r.status.name) for r in run.requests}

    slow = tokens(False)
    assert tokens(True) == slow

    def without_the_horizon(engine) -> bool:
        policy = engine.scheduler.policy
        return engine.batches is None and policy.arrivals_wait_in_async_runs(engine.scheduler)

    monkeypatch.setattr(async_decode_run, "takes_arrivals", without_the_horizon)
    assert tokens(True) != slow  # a run past the cluster's next event
