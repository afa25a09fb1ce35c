"""vLLM 0.32's DP prefill balancing, ``--prefill-schedule-interval`` (``policies/vllm_dp_prefill.py``):
the cadence of an MoE model's DP group, the scheduler's deferral, each worked by hand; the
scheduler's side is also checked step for step against vLLM's own ``Scheduler.schedule
(throttle_prefills=...)`` by the differential and its fixtures."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import dp_run, grants, scheduler_for, step
from tailserve.cluster.dp_group import LockstepStage
from tailserve.core.request import Request, RequestStatus
from tailserve.core.scheduler import Scheduler
from tailserve.executors.simulated.deployment import Deployment
from tailserve.policies.registry import PolicySpec
from tailserve.policies.vllm import VllmConfig, VllmPolicy
from tailserve.policies.vllm_dp_prefill import PrefillCadence, PrefillThrottle
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import parse_length


def test_the_cadence_throttles_off_its_steps_and_restarts_with_each_wave():
    cadence = PrefillCadence(3)
    seen = []
    for busy in (True, True, True, True, False, True, True):
        seen.append(cadence.throttles())
        cadence.stepped(not busy)
    # steps 0, 3 of the first wave admit; the group went idle after the fifth: a new wave at 0
    assert seen == [False, True, True, False, True, False, True]
    assert not any(PrefillCadence(1).throttles() for _ in range(3))


def test_a_throttled_step_defers_unless_capacity_bound_and_only_while_something_decodes():
    throttle = PrefillThrottle(throttled=True)
    assert throttle.defers(any_decoding=True)
    assert not throttle.defers(any_decoding=False)  # only prefills running: nothing to balance
    throttle.released(2)  # left two waiting, none deferred: capacity-bound
    assert throttle.capacity_bound and not throttle.defers(any_decoding=True)
    throttle.deferred = {object(), object()}
    throttle.released(2)  # both waiting are deferred (a connector's loads): not capacity-bound
    assert not throttle.capacity_bound


def _vllm(**flags) -> Scheduler:
    cfg = VllmConfig(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, "async_scheduling": False, **flags})
    policy = VllmPolicy(cfg)
    policy.prefill_throttle.tracking = True  # as a DP group with an interval above 1 sets it
    return scheduler_for(policy, 100, 16, 4096)


def test_a_waiting_prompt_waits_for_the_next_cadence_step():
    sched = _vllm()
    throttle = sched.policy.prefill_throttle
    sched.add_request(Request("a", 10, 20, 0.0), 0.0)
    assert grants(step(sched)) == [("a", 10, 0)]
    sched.add_request(Request("b", 12, 5, 0.0), 0.0)
    throttle.throttled = True
    assert grants(step(sched, 0.01)) == [("a", 1, 10)]  # a decodes, b waits
    throttle.throttled = False
    assert grants(step(sched, 0.02)) == [("a", 1, 11), ("b", 12, 0)]


def test_a_prompt_whose_whole_prefix_is_cached_is_not_held_back():
    # num_computed_tokens >= num_tokens - 1 after the hit: nothing to compute but the last token
    sched = _vllm(enable_prefix_caching=True)
    prompt = list(range(100, 132))
    sched.add_request(Request("a", 32, 20, 0.0, prompt_token_ids=prompt), 0.0)
    step(sched)
    step(sched, 0.01)
    sched.add_request(Request("b", 33, 5, 0.0, prompt_token_ids=[*prompt, 7]), 0.0)
    sched.policy.prefill_throttle.throttled = True
    assert ("b", 1, 32) in grants(step(sched, 0.02))  # a hit of 32 of its 33 tokens


def test_a_running_prefill_chunk_waits_on_a_throttled_step():
    sched = _vllm()
    throttle = sched.policy.prefill_throttle
    sched.add_request(Request("a", 10, 30, 0.0), 0.0)
    step(sched)
    sched.add_request(Request("b", 100, 5, 0.0), 0.0)
    assert grants(step(sched, 0.01)) == [("a", 1, 10), ("b", 63, 0)]  # its first chunk
    assert not throttle.capacity_bound  # nobody left waiting
    throttle.throttled = True
    assert grants(step(sched, 0.02)) == [("a", 1, 11)]  # b is mid-prefill: skipped
    throttle.throttled = False
    assert grants(step(sched, 0.03)) == [("a", 1, 12), ("b", 37, 63)]


def test_an_admitting_step_that_left_requests_waiting_lifts_the_next_throttle():
    sched = _vllm(max_num_seqs=2)
    throttle = sched.policy.prefill_throttle
    sched.add_request(Request("a", 10, 30, 0.0), 0.0)
    step(sched)
    sched.add_request(Request("b", 100, 5, 0.0), 0.0)
    sched.add_request(Request("c", 8, 5, 0.0), 0.0)
    assert grants(step(sched, 0.01)) == [("a", 1, 10), ("b", 63, 0)]  # c waits: max_num_seqs 2
    assert throttle.capacity_bound
    throttle.throttled = True
    assert grants(step(sched, 0.02)) == [("a", 1, 11), ("b", 37, 63)]  # capacity-bound: no deferral


def _dp_run(interval: int, n: int = 60):
    deployment = Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2)
    spec = WorkloadSpec(
        name="random", num_requests=n, rate=40.0, input_len=parse_length("uniform:200:1200"),
        output_len=parse_length("uniform:20:200"),
    )  # fmt: skip
    return dp_run(deployment, PolicySpec.make("vllm", {"prefill_schedule_interval": interval}), spec)


def test_an_moe_dp_group_admits_prompts_on_its_cadence():
    plain_stage, plain = _dp_run(1)
    stage, run = _dp_run(4)
    assert isinstance(stage, LockstepStage) and stage.cadence is not None and plain_stage.cadence is None
    for r in (*plain.requests, *run.requests):
        assert r.status is RequestStatus.FINISHED_LENGTH
    ttft = lambda rs: np.median([r.token_times[0] - r.arrival_time for r in rs])  # noqa: E731
    assert ttft(run.requests) > ttft(plain.requests)
    for replica in stage.replicas:
        assert not replica.engine.scheduler.policy.prefill_throttle.deferred  # every load over


@pytest.mark.parametrize("interval", [0, -1])
def test_the_interval_is_at_least_one(interval):
    with pytest.raises(ValueError, match="prefill_schedule_interval must be >= 1"):
        VllmConfig(max_num_batched_tokens=64, max_num_seqs=8, prefill_schedule_interval=interval)
