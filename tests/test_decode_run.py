"""The exact decode fast path gives the same results as stepping every iteration."""

from __future__ import annotations

import json

import pytest

from tailserve.core.engine import EngineOptions
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.arrivals import ArrivalSpec
from tailserve.workloads.lengths import LogNormal


def _run(policy: str, workload: WorkloadSpec, fast: bool, model="Llama-3-8B", hw="H100-SXM", tp=1):
    built = build_cost_model(Deployment(model, hw, tp, "none"))
    spec = parse_policy_list(policy)[0]
    return run_policy(built, spec, WorkloadBuilder(workload), options=EngineOptions(fast_forward=fast))


def _fingerprint(run) -> str:
    summary = run.summary()
    log = {name: getattr(run.log, name) for name in run.log.FIELDS}
    tokens = {r.request_id: (r.token_times, r.first_scheduled_time, r.num_preemptions) for r in run.requests}
    return json.dumps([summary, log, tokens], sort_keys=True)


WORKLOADS = [
    WorkloadSpec("chat", num_requests=120, rate=6.0, seed=3),
    WorkloadSpec("hol"),
    WorkloadSpec(
        "random",
        num_requests=150,
        rate=30.0,
        seed=5,
        input_len=LogNormal(800, 1.0, 6000),
        output_len=LogNormal(300, 0.8, 2000),
        arrival=ArrivalSpec("gamma", burstiness=0.5),
    ),
    WorkloadSpec(
        "random",
        num_requests=60,
        seed=1,
        input_len=LogNormal(500, 0.5, 2000),
        output_len=LogNormal(200, 0.5, 1000),
        arrival=ArrivalSpec("closed", concurrency=8),
    ),
]


@pytest.mark.parametrize(
    "policy",
    [
        # the synchronous scheduler (vLLM's --no-async-scheduling; on a GPU the default is async)
        "vllm:async_scheduling=false",
        "vllm:async_scheduling=false:max_num_batched_tokens=512",
        "orca",
        "trtllm:disable_overlap_scheduler=true",
        "trtllm:disable_overlap_scheduler=true:capacity_scheduler_policy=MAX_UTILIZATION",
        # TensorRT-LLM's overlap scheduler (its default): async_decode_run.py
        "trtllm",
        "trtllm:capacity_scheduler_policy=MAX_UTILIZATION",
        "trtllm:max_batch_size=8",
        # vLLM's async scheduling: executors/simulated/async_decode_run.py
        "vllm:async_scheduling=true",
        "vllm:async_scheduling=true:max_num_batched_tokens=512",
        "vllm:async_scheduling=true:scheduling_policy=priority:max_num_seqs=8",
    ],
)
@pytest.mark.parametrize("workload", WORKLOADS, ids=["chat", "hol", "bursty", "closed"])
def test_fast_path_equals_step_by_step(policy, workload):
    fast = _run(policy, workload, fast=True)
    slow = _run(policy, workload, fast=False)
    assert len(fast.log) == len(slow.log)
    assert _fingerprint(fast) == _fingerprint(slow)


@pytest.mark.parametrize("policy", ["vllm:async_scheduling=false", "vllm:async_scheduling=true"])
def test_fast_path_equals_step_by_step_under_preemption(policy):
    # Llama-2-13B on one A100-40GB leaves a small KV cache: this load makes vLLM preempt.
    workload = WorkloadSpec(
        "random",
        num_requests=200,
        rate=50.0,
        seed=2,
        input_len=LogNormal(1500, 0.6, 3000),
        output_len=LogNormal(600, 0.5, 1000),
    )
    fast = _run(policy, workload, True, "Llama-2-13B", "A100-40GB", 1)
    slow = _run(policy, workload, False, "Llama-2-13B", "A100-40GB", 1)
    assert fast.summary()["num_preemptions"] > 0
    assert _fingerprint(fast) == _fingerprint(slow)


@pytest.mark.parametrize(
    "policy, module, name",
    [
        ("vllm:async_scheduling=false", "decode_run", "advance_decode_run"),
        ("vllm:async_scheduling=true", "async_decode_run", "advance_async_decode_run"),
    ],
)
def test_fast_path_skips_most_iterations(monkeypatch, policy, module, name):
    import importlib

    runs = importlib.import_module(f"tailserve.executors.simulated.{module}")
    calls = []
    original = getattr(runs, name)

    def counting(engine):
        k = original(engine)
        calls.append(k)
        return k

    monkeypatch.setattr(runs, name, counting)
    run = _run(policy, WORKLOADS[0], fast=True)
    assert sum(calls) > len(run.log) / 2


def test_a_policy_without_fast_paths_is_always_stepped(monkeypatch):
    """``FastPaths`` is opt-in: ``static`` (whose batches wait on a timer) does not inherit it, so
    the simulator's driver never tries a run for it, and a fast-forwarding policy does."""
    from tailserve.executors.simulated import decode_run
    from tailserve.executors.simulated.fast_paths import FastPaths
    from tailserve.policies.registry import get_policy_cls

    assert not issubclass(get_policy_cls("static"), FastPaths)
    assert issubclass(get_policy_cls("vllm"), FastPaths)
    calls: list[int] = []
    original = decode_run.advance_decode_run

    def counting(engine):
        calls.append(1)
        return original(engine)

    monkeypatch.setattr(decode_run, "advance_decode_run", counting)
    stepped = _run("static", WORKLOADS[0], fast=True)
    assert not calls
    assert _fingerprint(stepped) == _fingerprint(_run("static", WORKLOADS[0], fast=False))


@pytest.mark.parametrize(
    "policy",
    ["vllm:async_scheduling=false", "sglang:disable_overlap_schedule=true", "sarathi:chunk_size=512"],
)
def test_a_run_goes_on_past_finishes_when_nobody_waits(monkeypatch, policy):
    """``finish_run.py``: with nobody waiting a run does not end at the first finish; one call
    finishes requests at several iterations, and the results are stepping's."""
    from tailserve.core.engine import Engine
    from tailserve.executors.simulated import finish_run

    finishes_per_call: list[int] = []
    original_run, original_end = finish_run.run_past_finishes, Engine.end_run

    def counting_run(engine, *args):
        finishes_per_call.append(0)
        return original_run(engine, *args)

    def counting_end(self, finished, end):
        if finished and finishes_per_call:
            finishes_per_call[-1] += 1
        return original_end(self, finished, end)

    monkeypatch.setattr(finish_run, "run_past_finishes", counting_run)
    monkeypatch.setattr(Engine, "end_run", counting_end)
    fast = _run(policy, WORKLOADS[0], fast=True)
    assert max(finishes_per_call) >= 3  # one call, three iterations that each finished requests
    monkeypatch.undo()
    assert _fingerprint(fast) == _fingerprint(_run(policy, WORKLOADS[0], fast=False))
