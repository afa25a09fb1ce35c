"""``Scheduler.one_behind_at``: the note a step's update (and a chunk run whose prompt sampled)
leaves when every running request is one token behind, which the driver's ``steady`` reads
instead of scanning the batch. Wherever the note is current (the clock still at its time) the
scan must agree; and runs that take it give results identical to plain stepping."""

from __future__ import annotations

import json

import pytest

from tailserve.assemble.build import BuildOptions, build_engine
from tailserve.core.engine import EngineOptions
from tailserve.core.executor import StepResult
from tailserve.core.request import Request
from tailserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tailserve.core.source import ListSource
from tailserve.executors.simulated import driver
from tailserve.executors.simulated.deployment import Deployment, build_cost_model
from tailserve.policies.registry import parse_policy_list
from tailserve.sim.run import run_policy
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import LogNormal

SPECS = [
    "vllm:async_scheduling=false",
    "vllm:async_scheduling=false,max_num_seqs=6",  # a queue waits behind a full batch
    "vllm:async_scheduling=false,max_num_batched_tokens=512,long_prefill_token_threshold=128",
    "sarathi:chunk_size=512",
    "sarathi:chunk_size=256,gpu_memory_utilization=0.25",  # KV pressure: preemptions
    "sglang:disable_overlap_schedule=true",
    "sglang:disable_overlap_schedule=true,chunked_prefill_size=256,max_running_requests=6",
    "tgi",
    "orca",
    "vllm_v0",
]

WORKLOAD = WorkloadSpec(
    "random",
    num_requests=100,
    rate=10.0,
    seed=11,
    input_len=LogNormal(700, 0.9, 4000),
    output_len=LogNormal(120, 0.9, 800),
)


def _fingerprint(spec: str, fast: bool) -> str:
    built = build_cost_model(Deployment("Llama-3-8B", "A100-80GB", 1, "none"))
    run = run_policy(
        built, parse_policy_list(spec)[0], WorkloadBuilder(WORKLOAD), options=EngineOptions(fast_forward=fast)
    )
    log = {name: getattr(run.log, name) for name in run.log.FIELDS}
    tokens = {r.request_id: (r.token_times, r.num_preemptions, r.status.name) for r in run.requests}
    return json.dumps([run.summary(), log, tokens], sort_keys=True)


@pytest.mark.parametrize("spec", SPECS)
def test_note_agrees_with_the_scan_and_runs_stay_exact(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    original = driver.steady
    taken: list[bool] = []

    def checked(engine) -> bool:
        sched = engine.scheduler
        current = sched.one_behind_at == engine.clock.now
        if current:
            # What the note vouches for, request by request.
            for r in sched.running:
                assert r.prompt_len + r.num_output_tokens - r.num_computed_tokens == 1, r.request_id
        answer = original(engine)
        note, sched.one_behind_at = sched.one_behind_at, None  # the scan's own answer
        assert original(engine) == answer
        sched.one_behind_at = note
        taken.append(current)
        return answer

    monkeypatch.setattr(driver, "steady", checked)
    fast = _fingerprint(spec, fast=True)
    monkeypatch.setattr(driver, "steady", original)
    assert fast == _fingerprint(spec, fast=False)
    if spec.startswith(("vllm:", "sarathi:")):
        assert True in taken and False in taken  # the note read, and the scan still run


def test_a_partial_chunk_or_an_unscheduled_request_leaves_no_note() -> None:
    """A step that left a prompt chunk short of its last token, or did not schedule every running
    request, notes nothing: the driver scans."""
    built = build_engine(
        Deployment("Llama-3-8B", "A100-80GB", 1, "none"),
        "vllm:async_scheduling=false",
        "sim",
        BuildOptions(shares_prefixes=False, engine=EngineOptions(fast_forward=False)),
        source=ListSource([]),
    )
    sched = built.scheduler
    a, b = Request("a", 64, 8, 0.0), Request("b", 64, 8, 0.0)
    for r in (a, b):
        sched.add_request(r, 0.0)
        sched.waiting.pop_request()
        sched.admit(r, 0.0)
        assert sched.allocate(r, 64)
    result = StepResult(0.01)
    # Both prompts' whole chunks: both sample, both scheduled.
    sched.update(SchedulerOutput([ScheduledRequest(a, 64, 0), ScheduledRequest(b, 64, 0)]), result, 0.01)
    assert sched.one_behind_at == 0.01
    # Only ``a`` decodes: ``b`` was not scheduled.
    sched.update(SchedulerOutput([ScheduledRequest(a, 1, 64)]), result, 0.02)
    assert sched.one_behind_at is None
    # A new schedule call drops the note before the policy decides.
    sched.update(SchedulerOutput([ScheduledRequest(a, 1, 65), ScheduledRequest(b, 1, 64)]), result, 0.03)
    assert sched.one_behind_at == 0.03
    sched.schedule(0.03)
    assert sched.one_behind_at is None
    c = Request("c", 64, 8, 0.0)
    sched.add_request(c, 0.03)
    sched.waiting.pop_request()
    sched.admit(c, 0.03)
    assert sched.allocate(c, 64)
    # A partial chunk: ``c`` computes 32 of its 64 prompt tokens.
    items = [ScheduledRequest(x, 1, x.num_computed_tokens) for x in (a, b)] + [ScheduledRequest(c, 32, 0)]
    sched.update(SchedulerOutput(items), result, 0.04)
    assert sched.one_behind_at is None
