"""TensorRT-LLM's attention-DP placement and balancing (policies/trtllm_adp.py,
cluster/adp_stage.py): hand-worked cases of each rule, then a group run with both."""

from __future__ import annotations

import pytest

from helpers import trtllm_line_read_back
from tailserve.cli import main
from tailserve.cluster.adp_stage import AdpLockstepStage
from tailserve.cluster.build import workload_requests
from tailserve.cluster.cluster import run_aggregated
from tailserve.cluster.dp_group import LockstepStage, build_dp_stage
from tailserve.cluster.replica import ReplicaSpec
from tailserve.core.engine import EngineOptions
from tailserve.core.request import Request
from tailserve.engines.flag_spec import NO_OP
from tailserve.engines.lint import lint
from tailserve.engines.translate import translate
from tailserve.executors.simulated.deployment import Deployment
from tailserve.executors.simulated.hardware import get_hardware
from tailserve.policies.registry import PolicySpec, get_policy_cls
from tailserve.policies.trtllm_adp import AdpBalance, RankLoad, StepCounts, num_to_fetch, place_requests
from tailserve.policies.trtllm_config import TrtllmConfig
from tailserve.sim.workload_builder import WorkloadBuilder
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.workloads.lengths import parse_length

H100 = get_hardware("H100").device_info
MOE = Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=2)
BALANCE = {
    "attention_dp_enable_balance": True,
    "attention_dp_batching_wait_iters": 3,
    "attention_dp_timeout_iters": 20,
}


# ---- placement ------------------------------------------------------------------------------------
def test_longest_prompt_first_to_the_rank_with_fewest_active_tokens():
    # expected = max(ceil(4 / 2), 0) = 2 per rank. 300 -> rank 0 (tie: lowest rank); 200 -> rank 1
    # (0 tokens); 100 -> rank 1 (200 < 300); rank 1 is full (2), so 50 -> rank 0.
    empty = [RankLoad(0, 0), RankLoad(0, 0)]
    assert place_requests([100, 300, 200, 50], empty) == [1, 0, 1, 0]


def test_the_per_rank_target_beats_the_token_count():
    # expected = max(ceil(4 / 2), 1) = 2: rank 1 (10 tokens) takes one, then is full; the second
    # goes to rank 0 although it holds 5,000 prompt tokens.
    assert place_requests([10, 10], [RankLoad(1, 5000), RankLoad(1, 10)]) == [1, 0]
    # expected = max(ceil(4 / 2), 3) = 3: rank 0 is at it, so rank 1 takes the request.
    assert place_requests([999], [RankLoad(3, 30), RankLoad(0, 0)]) == [1]


def test_the_shared_queue_gives_what_the_ranks_have_room_for():
    assert num_to_fetch([RankLoad(2, 0), RankLoad(1, 0)], max_num_active=2) == 1
    assert num_to_fetch([RankLoad(2, 0), RankLoad(2, 0)], max_num_active=2) == 0


# ---- balancing ------------------------------------------------------------------------------------
def test_a_lone_context_waits_until_timeout_iters():
    balance = AdpBalance(timeout_iters=9, batching_wait_iters=3, max_batch_size=8)
    lone = [StepCounts(1, 2), StepCounts(0, 2)]  # rank 1 has no context
    assert [balance.hold_contexts(lone) for _ in range(10)] == [True] * 8 + [False, True]
    assert balance.waiting_iters == 1  # reset at the timeout, counting again


def test_contexts_on_every_rank_wait_batching_wait_iters_while_all_decode():
    balance = AdpBalance(timeout_iters=9, batching_wait_iters=3, max_batch_size=8)
    balance.waiting_iters = 5
    every = [StepCounts(1, 2), StepCounts(2, 1)]
    assert [balance.hold_contexts(every) for _ in range(5)] == [True, True, True, False, True]
    assert balance.waiting_iters == 0


def test_contexts_run_at_once_where_a_rank_has_no_generation():
    balance = AdpBalance(timeout_iters=9, batching_wait_iters=3, max_batch_size=8)
    assert not balance.hold_contexts([StepCounts(1, 0), StepCounts(1, 2)])  # every rank a context
    assert not balance.hold_contexts([StepCounts(1, 2), StepCounts(0, 0)])  # not every rank
    assert balance.waiting_iters == 0 and balance.batching_iters == 0


def test_a_rank_without_free_slots_counts_as_a_rank_without_context():
    balance = AdpBalance(timeout_iters=9, batching_wait_iters=0, max_batch_size=2)
    assert balance.hold_contexts([StepCounts(1, 2), StepCounts(1, 1)])  # rank 0: 2 of 2 generations
    assert balance.waiting_iters == 1


def test_bad_values_are_refused_in_one_line():
    with pytest.raises(ValueError, match="attention_dp_timeout_iters must be >= 0"):
        TrtllmConfig(attention_dp_enable_balance=True, attention_dp_timeout_iters=-1)
    TrtllmConfig(attention_dp_timeout_iters=-1)  # AttentionDpConfig checks them only with balance on


# ---- the group ------------------------------------------------------------------------------------
def _stage(flags: dict) -> LockstepStage:
    return build_dp_stage(
        MOE,
        PolicySpec.make("trtllm", flags),
        shares_prefixes=False,
        options=EngineOptions(check_integrity=True),
    )


def _step_starts(stage: LockstepStage) -> list[float]:
    return sorted({row["start"] for r in stage.replicas for row in r.engine.log.rows()})


def _two_decoding_then(new: list[Request], flags: dict) -> tuple[LockstepStage, list[Request]]:
    """Two requests start together (one per rank) and decode; ``new`` arrive after step 0."""
    first = [Request(f"d{i}", 100, 100, 0.0) for i in range(2)]
    stage = _stage(flags)
    run = run_aggregated(stage, first + new)
    assert all(r.is_finished for r in run.requests)
    return stage, run.requests


def test_trtllm_moe_dp_is_the_adp_group_and_other_policies_are_not():
    assert isinstance(_stage({}), AdpLockstepStage)
    vllm = build_dp_stage(MOE, PolicySpec.make("vllm", {}), shares_prefixes=False)
    assert type(vllm) is LockstepStage


def test_a_context_on_each_rank_is_held_batching_wait_iters_steps():
    new = [Request(f"n{i}", 50, 5, 1e-6) for i in range(2)]
    stage, _ = _two_decoding_then(new, BALANCE)
    starts = _step_starts(stage)
    # step 0 runs d0, d1 (no rank decodes yet: no hold); steps 1-3 held (batching 1, 2, 3);
    # step 4 runs both contexts, in the same step.
    assert {r.engine.scheduler.policy.config.attention_dp_batching_wait_iters for r in stage.replicas} == {3}
    assert new[0].first_scheduled_time == new[1].first_scheduled_time == starts[4]
    assert stage.num_held_steps == 3
    plain, _ = _two_decoding_then([Request(f"n{i}", 50, 5, 1e-6) for i in range(2)], {})
    assert plain.balance is None and plain.num_held_steps == 0


def test_a_lone_context_is_released_at_timeout_iters():
    new = [Request("n0", 50, 5, 1e-6)]
    stage, _ = _two_decoding_then(new, BALANCE)
    starts = _step_starts(stage)
    # step 0: every rank has a context (waiting counter 0); from step 1 rank 1 has none, the
    # counter counts 1, 2, ... and reaches timeout_iters (20) at step 20, which runs it.
    assert new[0].first_scheduled_time == starts[20]
    assert stage.replicas[0].num_routed == 2  # placed on rank 0: equal load, lowest rank


@pytest.mark.parametrize("capacity", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_invariant_every_request_finishes_and_kv_is_conserved_with_balancing(capacity):
    spec = WorkloadSpec(
        name="random",
        num_requests=120,
        rate=40.0,
        input_len=parse_length("400"),
        output_len=parse_length("60"),
        seed=1,
    )
    deployment = Deployment.of("Qwen3-30B-A3B", "H100-SXM", 1, expert_parallel=True, dp=4)
    policy = PolicySpec.make(
        "trtllm", {**BALANCE, "capacity_scheduler_policy": capacity, "max_batch_size": 16}
    )
    stage = build_dp_stage(
        deployment, policy, shares_prefixes=False, options=EngineOptions(check_integrity=True)
    )  # fmt: skip
    run = run_aggregated(stage, workload_requests(WorkloadBuilder(spec), [ReplicaSpec(deployment, policy)]))
    assert all(r.is_finished for r in run.requests)
    assert sum(r.num_routed for r in stage.replicas) == 120 and not stage.queue
    assert stage.num_held_steps > 0
    for replica in stage.replicas:
        kv = replica.engine.scheduler.kv_cache
        assert kv.num_used_blocks == 0 and not replica.engine.scheduler.has_unfinished
    assert len({r.now for r in stage.replicas}) == 1


# ---- attention_dp_config in trtllm-serve's YAML ----------------------------------------------------
def test_the_yaml_keys_are_the_policy_flags_and_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "opts.yaml"
    path.write_text(
        "tensor_parallel_size: 2\nmoe_expert_parallel_size: 2\nenable_attention_dp: true\n"
        "attention_dp_config:\n  enable_balance: true\n  batching_wait_iters: 3\n  timeout_iters: 9\n"
    )
    t = translate(lint(f"trtllm-serve deepseek-ai/DeepSeek-R1 --config {path}"), H100)
    flags = {
        "attention_dp_enable_balance": True,
        "attention_dp_batching_wait_iters": 3,
        "attention_dp_timeout_iters": 9,
    }
    assert t.spec.flags == flags and t.deployment["dp"] == 2
    # tune's printed trtllm-serve line writes them back into its YAML
    spec = PolicySpec.make("trtllm", flags)
    dp = Deployment.of("Qwen3-30B-A3B", "H100", 1, expert_parallel=True, dp=2)
    back = trtllm_line_read_back(spec, dp, H100, tmp_path, monkeypatch)
    cls = get_policy_cls("trtllm")
    assert cls.default_config(H100, 8192, **back.spec.flags) == cls.default_config(H100, 8192, **flags)
    assert back.deployment["dp"] == 2 and back.deployment["tp"] == 1


def test_balancing_without_attention_dp_is_a_no_op_and_bad_values_stop_in_one_line(tmp_path, capsys):
    path = tmp_path / "opts.yaml"
    path.write_text("attention_dp_config:\n  enable_balance: true\n")
    rows = {row.flag: row for row in lint(f"trtllm-serve M --config {path}").rows}
    assert rows["opts.yaml:attention_dp_config.enable_balance"].verdict == NO_OP
    path.write_text("attention_dp_config:\n  enable_balance: true\n  timeout_iters: 4\n")
    rows = {row.flag: row for row in lint(f"trtllm-serve M --config {path}").rows}
    assert rows["opts.yaml:attention_dp_config.timeout_iters"].verdict == NO_OP
    path.write_text(
        "tensor_parallel_size: 2\nmoe_expert_parallel_size: 2\nenable_attention_dp: true\n"
        "attention_dp_config:\n  enable_balance: true\n  timeout_iters: -1\n"
    )
    argv = ["simulate", "--hardware", "H100", "--workload", "chat", "--num-requests", "4"]
    assert main([*argv, "--engine-cmd", f"trtllm-serve Qwen/Qwen3-30B-A3B --config {path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "tailserve: error: attention_dp_timeout_iters must be >= 0 with attention_dp_enable_balance, got -1"
    )
