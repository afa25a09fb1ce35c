"""Draft tokens in an MoE engine's lockstep data-parallel ranks (``cluster/dp_group.py``): each
rank verifies and drafts for its own requests with its own acceptance draws, and the group's step
waits for the slowest rank's forward pass and drafter — TensorRT-LLM's attention DP with MTP,
vLLM's DP ranks with an MTP drafter, SGLang's DP attention with NEXTN."""

from __future__ import annotations

import pytest

from tailserve.cluster.build import workload_requests
from tailserve.cluster.cluster import run_aggregated
from tailserve.cluster.dp_group import LockstepStage, build_dp_stage
from tailserve.cluster.replica import ReplicaSpec
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.spec_decode import accepted_drafts
from tailserve.policies.registry import PolicySpec
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import parse_length

MOE = Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2)
DRAFTS = {
    "trtllm": {"decoding_type": "MTP", "num_nextn_predict_layers": "2"},
    "vllm": {"speculative_method": "mtp", "num_speculative_tokens": "2"},
    "sglang": {"speculative_algorithm": "NEXTN", "speculative_num_steps": "2"},
}


def _run(policy: str, flags: dict[str, str], n: int = 24, output: str = "40"):
    spec = PolicySpec.make(policy, flags)
    work = WorkloadSpec(
        name="random",
        num_requests=n,
        rate=6.0,
        input_len=parse_length("300"),
        output_len=parse_length(output),
    )
    stage = build_dp_stage(MOE, spec, shares_prefixes=False)
    assert isinstance(stage, LockstepStage)
    run = run_aggregated(stage, workload_requests(WorkloadBuilder(work), [ReplicaSpec(MOE, spec)]))
    return stage, run


def _tokens_per_step(run) -> float:
    """Output tokens per step that produced some, over every request (a step's tokens share
    one time)."""
    tokens = sum(len(r.token_times) for r in run.requests)
    steps = sum(len(set(r.token_times)) for r in run.requests)
    return tokens / steps


@pytest.mark.parametrize("policy", sorted(DRAFTS))
def test_each_rank_accepts_its_drafts_and_the_ranks_keep_one_clock(policy):
    stage, run = _run(policy, {**DRAFTS[policy], "synthetic_acceptance_length": "2.5"})
    assert all(r.is_finished and r.num_output_tokens == r.max_tokens for r in run.requests)
    for replica in stage.replicas:  # every slot back
        assert replica.engine.scheduler.kv_cache.used_block_count() == 0
    steps: dict[float, float] = {}
    for replica in stage.replicas:
        for row in replica.engine.log.rows():
            assert steps.setdefault(row["start"], row["duration"]) == row["duration"]
    # 2.5 tokens per verification on average (2 drafts: rates 1, 0.5); prefills sample one
    assert 1.9 < _tokens_per_step(run) < 2.6


@pytest.mark.parametrize("policy", sorted(DRAFTS))
def test_drafts_nobody_accepts_cost_time_and_save_no_step(policy):
    """Acceptance length 1: every step samples one token, as without drafts, but each step
    verifies three tokens a decode and runs the drafter, so the run is longer."""
    plain_stage, _ = _run(policy, {})
    stage, run = _run(policy, {**DRAFTS[policy], "synthetic_acceptance_length": "1.0"})
    assert _tokens_per_step(run) == pytest.approx(1.0)
    assert all(r.num_output_tokens == r.max_tokens for r in run.requests)
    assert stage.now > plain_stage.now


def test_the_group_waits_for_the_slowest_ranks_drafter():
    """A group step with drafts is at least the step the cost model gives the ranks' shapes plus
    each busy rank's own drafter: the rank executors' ``drafts`` are what the step added."""
    from tailserve.cluster import dp_group

    seen: list[tuple[float, float, list[float]]] = []
    original = dp_group.LockstepStage.step

    def step(self):
        engines = [r.engine for r in self.replicas]
        before = [len(e.log) for e in engines]
        calls: list[float] = []
        forward: list[float] = []
        group_time = self.cost_model.group_time
        self.cost_model.group_time = lambda *a: forward.append(group_time(*a)) or forward[-1]
        wrapped = []
        for e in engines:
            own = e.executor.drafts

            def spy(out, shape, padded=0, _own=own):
                t, acc = _own(out, shape, padded)
                calls.append(t)
                return t, acc

            e.executor.drafts = spy
            wrapped.append((e, own))
        try:
            busy = original(self)
        finally:
            for e, own in wrapped:
                e.executor.drafts = own
            del self.cost_model.group_time
        rows = [e.log.duration[-1] for e, n in zip(engines, before, strict=True) if len(e.log) > n]
        if calls and rows:
            seen.append((rows[0], forward[0], calls))
        return busy

    dp_group.LockstepStage.step = step
    try:
        _run("trtllm", {**DRAFTS["trtllm"], "synthetic_acceptance_length": "2.0"}, n=8)
    finally:
        dp_group.LockstepStage.step = original
    assert len(seen) > 20
    for duration, forward, drafting in seen:
        assert max(drafting) > 0
        assert duration == pytest.approx(forward + max(drafting), rel=1e-12)


def test_acceptance_draws_are_the_ranks_own():
    """Each verification accepts what ``accepted_drafts`` gives its request at its context: the
    same draw a single engine makes, whatever else the group runs."""
    stage, run = _run("vllm", {**DRAFTS["vllm"], "synthetic_acceptance_length": "2.2"}, n=10)
    executor = stage.replicas[0].engine.executor
    spec = executor.spec
    for r in run.requests:
        # replay: each step after the first token accepts the draw at the context it verified from
        computed = r.prompt_len
        times = r.token_times
        i = 1  # the prefill's token
        while i < len(times):
            n_step = times.count(times[i])
            draw = accepted_drafts(spec, executor.seed, r.request_id, computed)
            assert n_step == min(1 + draw, r.max_tokens - i)
            computed += n_step
            i += n_step
